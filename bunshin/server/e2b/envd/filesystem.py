"""envd's ``filesystem.Filesystem`` service, over the workspace's agent.

Paths may be relative: they resolve in the call's user's home (``/root`` for root). A
watch (``WatchDir`` streaming, or ``CreateWatcher`` polled by ``GetWatcherEvents``) looks
at the folder's listing every ``WATCH_POLL_S`` and reports what appeared (create), changed
size or time (write) and went (remove): no inotify descriptor is held in the workspace, so
a watched sandbox still forks. Watchers are bounded per sandbox and dropped when unpolled
for ``WATCHER_IDLE_S``; a ``WatchDir`` client that hangs up ends its watch.
"""

from __future__ import annotations

import posixpath
import secrets
import stat as st
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from ....errors import InvalidArgument, PathNotFound
from ....runtime.agent_host.types import FileEntry
from . import procs
from .gen.filesystem import filesystem_pb2 as pb
from .rpc import WATCHING, Call, service_app

MAX_PATH = 4096
#: Most entries one ListDir answers, and one watch follows.
MAX_ENTRIES = 10_000
MAX_DEPTH = 32
WATCH_POLL_S = 0.1
MAX_WATCHERS = 64  # per sandbox
WATCHER_IDLE_S = 600.0
MAX_EVENTS = 10_000  # held per watcher between two polls; older ones dropped
_TYPES = {"file": pb.FILE_TYPE_FILE, "dir": pb.FILE_TYPE_DIRECTORY, "symlink": pb.FILE_TYPE_SYMLINK}
_KIND_BITS = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}


def resolve(call: Call, path: str) -> str:
    """``path`` made absolute (in the user's home) and normalized; bounded."""
    if not path or len(path) > MAX_PATH or "\0" in path:
        raise InvalidArgument(f"path must be 1..{MAX_PATH} characters without NUL")
    if not path.startswith("/"):
        home = "/root" if call.user in (None, "root") else procs.passwd_entry(call, call.user)[2]
        path = posixpath.join(home, path)
    return posixpath.normpath(path)


def entry(e: FileEntry, path: str) -> Any:
    info = pb.EntryInfo(name=e.name or posixpath.basename(path) or "/", type=_TYPES.get(e.type, pb.FILE_TYPE_UNSPECIFIED),
                        path=path, size=e.size, mode=e.mode & 0o7777, permissions=st.filemode(_KIND_BITS.get(e.type, 0) | (e.mode & 0o7777)),
                        owner="", group="")
    info.modified_time.FromNanoseconds(int(e.mtime * 1e9))
    if e.link_target is not None:
        info.symlink_target = e.link_target
    return info


def _stat(call: Call, path: str) -> Any:
    return entry(call.ws.agent().stat(path), path)


def _walk(call: Call, root: str, depth: int) -> list[Any]:
    out: list[Any] = []
    todo = [(root, 1)]
    while todo:
        folder, level = todo.pop()
        for e in call.ws.files.list(folder):
            path = posixpath.join(folder, e.name)
            out.append(entry(e, path))
            if len(out) > MAX_ENTRIES:
                raise InvalidArgument(f"{root} holds over {MAX_ENTRIES} entries to depth {depth}",
                                      hint="list a smaller depth or a deeper folder")
            if e.type == "dir" and level < depth:
                todo.append((path, level + 1))
    return out


async def stat(req: Any, call: Call, ctx: RequestContext) -> Any:
    path = resolve(call, req.path)
    return pb.StatResponse(entry=await procs.run(call, _stat, call, path))


async def list_dir(req: Any, call: Call, ctx: RequestContext) -> Any:
    path, depth = resolve(call, req.path), req.depth or 1
    if depth > MAX_DEPTH:
        raise ConnectError(Code.INVALID_ARGUMENT, f"depth is over {MAX_DEPTH}")
    top = await procs.run(call, _stat, call, path)
    if top.type != pb.FILE_TYPE_DIRECTORY:
        raise ConnectError(Code.INVALID_ARGUMENT, f"path {path} is not a directory")
    return pb.ListDirResponse(entries=await procs.run(call, _walk, call, path, depth))


def _make_dir(call: Call, path: str) -> Any:
    try:
        call.ws.agent().stat(path)
    except PathNotFound:
        pass
    else:
        raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
    r = call.ws.exec(["mkdir", "-p", "--", path], timeout=30)
    if r.exit_code != 0:
        raise InvalidArgument(f"cannot make {path}: {r.stderr.strip()[:200]}")
    procs.give_to_user(call, path)
    return _stat(call, path)


async def make_dir(req: Any, call: Call, ctx: RequestContext) -> Any:
    return pb.MakeDirResponse(entry=await procs.run(call, _make_dir, call, resolve(call, req.path)))


def _move(call: Call, src: str, dst: str) -> Any:
    call.ws.agent().stat(src)  # PathNotFound: not_found
    r = call.ws.exec(["mv", "-f", "--", src, dst], timeout=60)
    if r.exit_code != 0:
        raise InvalidArgument(f"cannot move {src} to {dst}: {r.stderr.strip()[:200]}")
    return _stat(call, dst)


async def move(req: Any, call: Call, ctx: RequestContext) -> Any:
    src, dst = resolve(call, req.source), resolve(call, req.destination)
    return pb.MoveResponse(entry=await procs.run(call, _move, call, src, dst))


async def remove(req: Any, call: Call, ctx: RequestContext) -> Any:
    path = resolve(call, req.path)
    await procs.run(call, call.ws.files.remove, path, recursive=True)
    return pb.RemoveResponse()


# --- watching -----------------------------------------------------------------------

Seen = dict[str, tuple[int, float, str]]  # path -> (size, mtime, type)


def _look(call: Call, path: str, recursive: bool) -> Seen:
    seen: Seen = {}
    for e in _walk(call, path, MAX_DEPTH if recursive else 1):
        seen[e.path] = (e.size, e.modified_time.ToNanoseconds(), str(e.type))
    return seen


def _diff(root: str, old: Seen, new: Seen) -> list[Any]:
    events = []
    for p, v in new.items():
        name = posixpath.relpath(p, root)
        if p not in old:
            events.append(pb.FilesystemEvent(name=name, type=pb.EVENT_TYPE_CREATE))
        elif old[p] != v:
            events.append(pb.FilesystemEvent(name=name, type=pb.EVENT_TYPE_WRITE))
    events += [pb.FilesystemEvent(name=posixpath.relpath(p, root), type=pb.EVENT_TYPE_REMOVE)
               for p in old if p not in new]
    return events


async def _start_watch(call: Call, path_in: str, recursive: bool) -> tuple[str, Seen]:
    path = resolve(call, path_in)
    top = await procs.run(call, _stat, call, path)
    if top.type != pb.FILE_TYPE_DIRECTORY:
        raise ConnectError(Code.INVALID_ARGUMENT, f"path {path} is not a directory")
    return path, await procs.run(call, _look, call, path, recursive)


async def watch_dir(req: Any, call: Call, ctx: RequestContext) -> AsyncIterator[Any]:
    with WATCHING.held(call.ws.id):
        async for e in _watch(req, call):
            yield e


async def _watch(req: Any, call: Call) -> AsyncIterator[Any]:
    path, seen = await _start_watch(call, req.path, req.recursive)
    yield pb.WatchDirResponse(start=pb.WatchDirResponse.StartEvent())
    last = time.monotonic()
    while not call.gone.is_set():  # a client that hung up ends its watch
        await anyio.sleep(WATCH_POLL_S)
        try:
            now = await procs.poll(call, _look, call, path, req.recursive)
        except PathNotFound:
            raise ConnectError(Code.NOT_FOUND, f"watched folder {path} was removed") from None
        for ev in _diff(path, seen, now):
            yield pb.WatchDirResponse(filesystem=ev)
            last = time.monotonic()
        seen = now
        if time.monotonic() - last > 30:
            last = time.monotonic()
            yield pb.WatchDirResponse(keepalive=pb.WatchDirResponse.KeepAlive())


@dataclass
class Watcher:
    sandbox_id: str
    path: str
    recursive: bool
    seen: Seen
    polled: float = field(default_factory=time.monotonic)


class Watchers:
    """The polled watchers of every sandbox, bounded and expiring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: dict[str, Watcher] = {}

    def add(self, w: Watcher) -> str:
        with self._lock:
            now = time.monotonic()
            for wid in [k for k, v in self._all.items() if now - v.polled > WATCHER_IDLE_S]:
                del self._all[wid]
            if sum(v.sandbox_id == w.sandbox_id for v in self._all.values()) >= MAX_WATCHERS:
                raise ConnectError(Code.RESOURCE_EXHAUSTED, f"the sandbox has {MAX_WATCHERS} watchers: remove some")
            wid = secrets.token_hex(8)
            self._all[wid] = w
            return wid

    def get(self, wid: str, sandbox_id: str) -> Watcher:
        with self._lock:
            w = self._all.get(wid)
        if w is None or w.sandbox_id != sandbox_id:  # another sandbox's watcher is not there for this one
            raise ConnectError(Code.NOT_FOUND, f"watcher {wid[:40]!r} not found")
        w.polled = time.monotonic()
        return w

    def remove(self, wid: str, sandbox_id: str) -> None:
        self.get(wid, sandbox_id)
        with self._lock:
            self._all.pop(wid, None)


def app() -> Any:
    watchers = Watchers()

    async def create_watcher(req: Any, call: Call, ctx: RequestContext) -> Any:
        path, seen = await _start_watch(call, req.path, req.recursive)
        return pb.CreateWatcherResponse(watcher_id=watchers.add(Watcher(call.ws.id, path, req.recursive, seen)))

    async def get_watcher_events(req: Any, call: Call, ctx: RequestContext) -> Any:
        w = watchers.get(req.watcher_id, call.ws.id)
        try:
            now = await procs.run(call, _look, call, w.path, w.recursive)
        except PathNotFound:
            raise ConnectError(Code.NOT_FOUND, f"watched folder {w.path} was removed") from None
        events, w.seen = _diff(w.path, w.seen, now)[-MAX_EVENTS:], now
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(req: Any, call: Call, ctx: RequestContext) -> Any:
        watchers.remove(req.watcher_id, call.ws.id)
        return pb.RemoveWatcherResponse()

    return service_app(pb.DESCRIPTOR.services_by_name["Filesystem"],
                       unary={"Stat": stat, "ListDir": list_dir, "MakeDir": make_dir, "Move": move, "Remove": remove,
                              "CreateWatcher": create_watcher, "GetWatcherEvents": get_watcher_events,
                              "RemoveWatcher": remove_watcher},
                       streams={"WatchDir": watch_dir})
