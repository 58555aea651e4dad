"""The async seam: :class:`AsyncWorkspace` over any blocking workspace, through one thread bridge.

The workspace protocols block (a fork waits for CRIU, a command for its exit), and
the cache, speculation and rollout engine are async. Every blocking call they make
goes through one :class:`ThreadBridge` (one thread pool for the process), and every
call into one workspace through that workspace's lock:

- one call at a time per workspace: nothing may be in flight in a workspace while it
  is snapshotted or forked (the dump would meet the open agent connection). Calls
  queue on an ``asyncio.Lock`` per :class:`AsyncWorkspace`, and run in their thread
  under the process's lock of that workspace id (:mod:`bunshin.workspace.locks`), so
  another caller in the process (a server route) does not overlap them either;
- cancel-safe: cancelling the awaiting task does not stop a call already running in
  its thread. The workspace's lock stays held until that thread is done (the next
  call cannot overlap it), and what a cancelled fork, snapshot or restore created is
  removed when it arrives, so a trajectory that timed out leaves nothing running.
  A call still waiting for a thread is dropped.
- ``remove(wait=False)`` is the one call that does not wait for the lock: it removes
  the workspace under a running call (which then fails), to cancel a speculation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, overload

from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container.stats import WorkspaceStats
from ..runtime.state.records import SnapshotMode
from .forks import ForkResult
from .locks import WorkspaceLocks, workspace_locks
from .protocol import Command, SnapshotAPI, WorkspaceAPI

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Threads of the default bridge: every workspace call in flight holds one.
DEFAULT_MAX_THREADS = 64


class ThreadBridge:
    """One thread pool running blocking calls for async code; made on first use."""

    def __init__(self, max_threads: int = DEFAULT_MAX_THREADS, *, name: str = "bunshin") -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, not {max_threads}")
        self._max_threads = max_threads
        self._name = name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def max_threads(self) -> int:
        """Threads the pool may run at once."""
        return self._max_threads

    def resize(self, max_threads: int) -> None:
        """At least ``max_threads`` threads from now on (a pool already made is replaced;
        calls running in the old one finish there)."""
        with self._lock:
            if max_threads <= self._max_threads:
                return
            self._max_threads = max_threads
            old, self._pool = self._pool, None
        if old is not None:
            old.shutdown(wait=False)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kw: Any) -> Future[T]:
        """Run ``fn(*args, **kw)`` in the pool; its future."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._max_threads, thread_name_prefix=self._name)
            return self._pool.submit(fn, *args, **kw)

    async def run_sync(self, fn: Callable[..., T], /, *args: Any,
                       undo: Callable[[T], object] | None = None, **kw: Any) -> T:
        """``fn(*args, **kw)`` in a thread; if the caller is cancelled while it runs,
        ``undo`` gets its result once it arrives."""
        return await wait(self.submit(fn, *args, **kw), undo=undo)

    def shutdown(self) -> None:
        """Wait for running calls and free the threads (a later call makes a new pool)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


async def wait(fut: Future[T], *, undo: Callable[[T], object] | None = None) -> T:
    """Await a thread's future, cancel-safe (see the module docstring)."""
    afut = asyncio.wrap_future(fut)
    afut.add_done_callback(_retrieve)
    try:
        return await asyncio.shield(afut)
    except asyncio.CancelledError:
        if not fut.cancel() and undo is not None:
            fut.add_done_callback(lambda f: _undo(f, undo))
        raise


def _retrieve(f: asyncio.Future[Any]) -> None:
    """Nobody may await a cancelled caller's future: read its error so asyncio does not log it."""
    if not f.cancelled():
        f.exception()


def _undo(f: Future[T], undo: Callable[[T], object]) -> None:
    if f.cancelled() or f.exception() is not None:
        return
    quietly(undo, f.result())


def quietly(fn: Callable[[T], object], arg: T) -> None:
    """Cleanup that must not mask what it cleans up after: failures are logged."""
    try:
        fn(arg)
    except Exception as e:
        log.warning("cleanup failed: %s", e)


_default_bridge = ThreadBridge()


def default_bridge() -> ThreadBridge:
    """The process's bridge, used unless one is given."""
    return _default_bridge


def _remove_one(obj: WorkspaceAPI | SnapshotAPI) -> None:
    obj.remove()


def _remove_all(items: Sequence[WorkspaceAPI]) -> None:
    for ws in items:
        quietly(_remove_one, ws)


class AsyncWorkspace:
    """Any :class:`~bunshin.workspace.protocol.WorkspaceAPI`, awaitable, one call at a time."""

    def __init__(self, ws: WorkspaceAPI, *, bridge: ThreadBridge | None = None,
                 locks: WorkspaceLocks | None = None) -> None:
        self._ws = ws
        self._bridge = bridge or default_bridge()
        self._locks = locks or workspace_locks()
        self._lock = asyncio.Lock()
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.sessions = AsyncSessions(self)

    @classmethod
    async def create(cls, image: str = "host", *, bridge: ThreadBridge | None = None,
                     **options: Any) -> AsyncWorkspace:
        """A new workspace on this machine, awaitable: ``await AsyncWorkspace.create("host", memory="1G")``.

        ``options`` are :meth:`bunshin.Workspace.create`'s (``name``, ``memory``, ``pids``,
        ``command``, ``mounts``, ``desktop``, ``config``). It is made in a bridge thread; if
        the caller is cancelled meanwhile, the workspace is removed once it is made.
        (Workspaces on a ``bunshin serve`` host: :meth:`bunshin.AsyncClient.create`.)
        """
        from .workspace import Workspace

        b = bridge or default_bridge()
        ws = await b.run_sync(functools.partial(Workspace.create, image, **options), undo=_remove_one)
        return cls(ws, bridge=b)

    @classmethod
    async def get(cls, ref: str, *, bridge: ThreadBridge | None = None, **options: Any) -> AsyncWorkspace:
        """The local workspace ``ref`` (an id or a name; ``options``: ``config``), awaitable."""
        from .workspace import Workspace

        b = bridge or default_bridge()
        return cls(await b.run_sync(functools.partial(Workspace.get, ref, **options)), bridge=b)

    async def __aenter__(self) -> AsyncWorkspace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """``async with``: removed on the way out."""
        await self.remove()

    @property
    def sync(self) -> WorkspaceAPI:
        """The blocking workspace underneath (use it only from a bridge thread)."""
        return self._ws

    @property
    def id(self) -> str:
        """The workspace's id."""
        return self._ws.id

    @property
    def bridge(self) -> ThreadBridge:
        """The thread bridge its calls run through."""
        return self._bridge

    def __repr__(self) -> str:
        return f"AsyncWorkspace({self._ws!r})"

    async def call(self, fn: Callable[..., T], /, *args: Any,
                   undo: Callable[[T], object] | None = None, **kw: Any) -> T:
        """Run blocking ``fn(*args, **kw)`` under this workspace's lock, e.g. a tool:
        ``await aws.call(tools.run_sync, aws.sync, name, args)``."""
        await self._lock.acquire()
        loop = asyncio.get_running_loop()
        try:
            fut = self._bridge.submit(self._held, fn, *args, **kw)
        except BaseException:
            self._lock.release()
            raise
        fut.add_done_callback(lambda _: _release_from_thread(loop, self._lock))
        return await wait(fut, undo=undo)

    def _held(self, fn: Callable[..., T], /, *args: Any, **kw: Any) -> T:
        with self._locks.held(self._ws):
            return fn(*args, **kw)

    @overload
    async def exec(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: str | None = None,
                   text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    async def exec(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: str | None = None,
                   text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    async def exec(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: str | None = None,
                   text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    async def exec(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, stdin: str | None = None,
                   text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        """Run one command and wait (:meth:`bunshin.Workspace.exec`; ``timeout`` default 600 s)."""
        return await self.call(self._ws.exec, command, timeout=timeout, cwd=cwd, env=env,
                               stdin=stdin, text=text)

    async def processes(self) -> list[ProcessInfo]:
        """The processes inside."""
        return await self.call(self._ws.processes)

    async def stats(self) -> WorkspaceStats:
        """Read on the host (cgroup and /proc), so it does not wait for a running call."""
        return await self._bridge.run_sync(self._ws.stats)

    async def set_cpu_priority(self, nice: int) -> None:
        """The whole workspace's CPU priority as a nice value 0..19."""
        await self.call(self._ws.set_cpu_priority, nice)

    async def is_alive(self) -> bool:
        """Whether its processes still run (read on the host: does not wait for a running call)."""
        return await self._bridge.run_sync(self._ws.is_alive)

    async def snapshot(self, *, mode: SnapshotMode | str = SnapshotMode.COW) -> AsyncSnapshot:
        """Capture it while it keeps running; kept until removed."""
        snap = await self.call(self._ws.snapshot, mode=mode, undo=_remove_one)
        return AsyncSnapshot(snap, bridge=self._bridge)

    async def fork(self, n: int = 1, *, mode: SnapshotMode | str = SnapshotMode.COW) -> list[AsyncWorkspace]:
        """``n`` live clones (see :meth:`bunshin.Workspace.fork`); a local fork's list has
        its ``timings`` (:class:`~bunshin.workspace.forks.ForkTimings`)."""
        clones = await self.call(self._ws.fork, n, mode=mode, undo=_remove_all)
        wrapped = [AsyncWorkspace(c, bridge=self._bridge) for c in clones]
        return ForkResult(wrapped, clones.timings) if isinstance(clones, ForkResult) else wrapped

    async def remove(self, *, wait: bool = True) -> None:
        """Remove it once the running call is done; ``wait=False``: now, under that call."""
        if wait:
            await self.call(self._ws.remove)
        else:
            await self._bridge.run_sync(self._ws.remove)
        self._locks.drop(self._ws)


def _release_from_thread(loop: asyncio.AbstractEventLoop, lock: asyncio.Lock) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the lock
        loop.call_soon_threadsafe(lock.release)


class AsyncSnapshot:
    """Any :class:`~bunshin.workspace.protocol.SnapshotAPI`, awaitable."""

    def __init__(self, snap: SnapshotAPI, *, bridge: ThreadBridge | None = None) -> None:
        self._snap = snap
        self._bridge = bridge or default_bridge()

    @property
    def sync(self) -> SnapshotAPI:
        """The blocking snapshot underneath."""
        return self._snap

    @property
    def id(self) -> str:
        """The snapshot's id."""
        return self._snap.id

    @property
    def size_bytes(self) -> int:
        """What it holds: memory files, images and its file layer."""
        return self._snap.size_bytes

    def __repr__(self) -> str:
        return f"AsyncSnapshot({self._snap!r})"

    async def restore(self, n: int = 1) -> list[AsyncWorkspace]:
        """``n`` new running workspaces in this state; all of them or none."""
        clones = await self._bridge.run_sync(self._snap.restore, n, undo=_remove_all)
        return [AsyncWorkspace(c, bridge=self._bridge) for c in clones]

    async def remove(self) -> None:
        """Drop it; its files go once no restored workspace stacks on them."""
        await self._bridge.run_sync(self._snap.remove)


class AsyncCommands:
    def __init__(self, aws: AsyncWorkspace) -> None:
        self._aws = aws

    @overload
    async def run(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, stdin: str | None = None,
                  max_output: int | None = None, text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    async def run(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, stdin: str | None = None,
                  max_output: int | None = None, text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    async def run(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, stdin: str | None = None,
                  max_output: int | None = None, text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    async def run(self, command: Command, *, timeout: float | None = None, cwd: str | None = None,
                  env: dict[str, str] | None = None, stdin: str | None = None,
                  max_output: int | None = None, text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        """Run and wait (``timeout``: default 600 s; ``text=False``: exact bytes)."""
        return await self._aws.call(self._aws.sync.commands.run, command, timeout=timeout, cwd=cwd,
                                    env=env, stdin=stdin, max_output=max_output, text=text)

    async def spawn(self, command: Command, *, cwd: str | None = None,
                    env: dict[str, str] | None = None) -> int:
        """Start a command in the background; its pid inside."""
        return await self._aws.call(self._aws.sync.commands.spawn, command, cwd=cwd, env=env)


class AsyncFiles:
    def __init__(self, aws: AsyncWorkspace) -> None:
        self._aws = aws

    async def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of the file at ``path`` (from ``offset``, ``length`` of them or to the end)."""
        return await self._aws.call(self._aws.sync.files.read, path, offset=offset, length=length)

    async def read_text(self, path: str) -> str:
        """The whole file at ``path`` as UTF-8 text."""
        return await self._aws.call(self._aws.sync.files.read_text, path)

    async def write(self, path: str, data: bytes | str, *, mode: int | None = None) -> int:
        """Write ``data`` to ``path`` (parent folders made); the bytes written."""
        return await self._aws.call(self._aws.sync.files.write, path, data, mode=mode)

    async def list(self, path: str = "/") -> list[FileEntry]:
        """The entries of the folder ``path``."""
        return await self._aws.call(self._aws.sync.files.list, path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file (or, ``recursive``, the folder) at ``path``."""
        await self._aws.call(self._aws.sync.files.remove, path, recursive=recursive)


class AsyncSessions:
    def __init__(self, aws: AsyncWorkspace) -> None:
        self._aws = aws

    async def list(self) -> list[SessionInfo]:
        """The open sessions."""
        return await self._aws.call(self._aws.sync.sessions.list)

    async def open(self, kind: str = "bash", *, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> str:
        """Open a persistent shell session (``bash`` or ``sh``); its id."""
        return await self._aws.call(self._aws.sync.sessions.open, kind, cwd=cwd, env=env)

    async def run(self, session_id: str, command: str, *, timeout: float | None = None,
                  max_output: int | None = None) -> SessionResult:
        """Run ``command`` in the session; a timeout interrupts the command, not the session."""
        return await self._aws.call(self._aws.sync.sessions.run, session_id, command,
                                    timeout=timeout, max_output=max_output)

    async def close(self, session_id: str) -> None:
        """End the session ``session_id``."""
        await self._aws.call(self._aws.sync.sessions.close, session_id)
