"""An in-memory workspace and snapshot that satisfy bunshin's workspace protocols.

For tests of the layers above the runtime (tools, cache, speculation, rollout): no
root, no containers. ``FakeWorkspace`` and ``FakeSnapshot`` implement
:class:`~bunshin.workspace.protocol.WorkspaceAPI` and ``SnapshotAPI`` (a test checks
it); their state is a dict of files, the sessions' variables and cwd, and a list of
background processes. Commands and sessions understand a tiny shell (statements split
on ``;``)::

    echo WORDS | export K=V | K=V | cd DIR | sleep S | cat P | write P TEXT
    append P TEXT | rm P | ls | inc P (add 1 to the number in P, print it)
    random | bg NAME (start a background process) | exit N (status N)

plus the test's own (``FakeWorld(commands={"score": fn})``). ``$K`` expands variables. Like the real runtime, a ``fork``/``snapshot`` while a
call is in flight in that workspace fails (the host would hold a connection
across the dump), and every object is counted in the ``FakeWorld`` so tests can
check that nothing leaked::

    world = FakeWorld()
    ws = world.create(workdir="/w")
    sid = ws.sessions.open("bash", cwd="/w")
    ws.sessions.run(sid, "export X=1; inc n")
    (clone,) = ws.fork(1)
    assert world.leftovers(keep=[ws.id, clone.id]) == {}
"""

from __future__ import annotations

import builtins
import copy
import itertools
import json
import random
import re
import shlex
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, overload

from ..errors import AgentError, InvalidArgument, PathNotFound, SnapshotNotFound, StateConflict
from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    FileType,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container.stats import MemoryStats, WorkspaceStats
from ..runtime.state.records import SnapshotMode
from ..workspace.protocol import SnapshotAPI, WorkspaceAPI

__all__ = ["FakeSnapshot", "FakeState", "FakeWorkspace", "FakeWorld"]


@dataclass
class _Session:
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/"
    alive: bool = True


@dataclass
class FakeState:
    files: dict[str, bytes] = field(default_factory=dict)
    sessions: dict[str, _Session] = field(default_factory=dict)
    procs: list[str] = field(default_factory=list)

    def size(self) -> int:
        return 4096 + sum(len(k) + len(v) for k, v in self.files.items()) + 256 * len(self.sessions)


@dataclass
class FakeWorld:
    """Registry and counters shared by every fake object of one test."""

    fork_s: float = 0.0  # simulated latency of a dump and of each restore
    live_workspaces: set[str] = field(default_factory=set)
    snapshots: dict[str, FakeSnapshot] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"snapshot": 0, "restore": 0, "fork": 0, "run": 0})
    #: Extra shell commands for a test: name -> ``fn(workspace, args) -> (output, status)``.
    commands: dict[str, Callable[[FakeWorkspace, builtins.list[str]], tuple[str, int]]] = field(
        default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def new_id(self, prefix: str) -> str:
        with self.lock:
            return f"{prefix}-{next(self._ids)}"

    def bump(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def create(self, *, workdir: str = "/") -> FakeWorkspace:
        state = FakeState()
        state.files[workdir.rstrip("/") + "/.keep"] = b""
        return FakeWorkspace(self, state)

    def leftovers(self, *, keep: Sequence[str] = ()) -> dict[str, list[str]]:
        left = {"workspaces": sorted(self.live_workspaces - set(keep)),
                "snapshots": sorted(set(self.snapshots) - set(keep))}
        return {k: v for k, v in left.items() if v}


@dataclass(frozen=True)
class FakeSnapshotRecord:
    memfile_bytes: int
    image_bytes: int
    layer_bytes: int


class FakeSnapshot:
    def __init__(self, world: FakeWorld, state: FakeState) -> None:
        self.world = world
        self.id = world.new_id("fsnap")
        self._state = copy.deepcopy(state)
        self.record = FakeSnapshotRecord(self._state.size(), 1024, 0)
        world.snapshots[self.id] = self

    @classmethod
    def get(cls, ref: str, *, world: FakeWorld) -> FakeSnapshot:
        try:
            return world.snapshots[ref]
        except KeyError:
            raise SnapshotNotFound(f"no snapshot {ref!r}") from None

    def restore(self, n: int = 1) -> list[FakeWorkspace]:
        if self.id not in self.world.snapshots:
            raise SnapshotNotFound(f"snapshot {self.id} was removed")
        out = []
        for _ in range(n):
            time.sleep(self.world.fork_s)
            self.world.bump("restore")
            out.append(FakeWorkspace(self.world, copy.deepcopy(self._state)))
        return out

    def remove(self) -> None:
        self.world.snapshots.pop(self.id, None)

    @property
    def size_bytes(self) -> int:
        rec = self.record
        return rec.memfile_bytes + rec.image_bytes + rec.layer_bytes

    def __repr__(self) -> str:
        return f"FakeSnapshot({self.id!r})"


class FakeWorkspace:
    def __init__(self, world: FakeWorld, state: FakeState) -> None:
        self.world = world
        self.id = world.new_id("fws")
        self.state = state
        self.commands = FakeCommands(self)
        self.files = FakeFiles(self)
        self.sessions = FakeSessions(self)
        self.alive = True
        self._inflight = 0
        self._lock = threading.Lock()
        self._sids = itertools.count(1)
        self.cpu_nice = 0
        self.cpu_s = 0.0  # the wall time of its calls, counted as CPU time
        world.live_workspaces.add(self.id)

    def __repr__(self) -> str:
        return f"FakeWorkspace({self.id!r})"

    # --- lifecycle ------------------------------------------------------------------

    @contextmanager
    def in_call(self) -> Iterator[None]:
        """Around every call into the workspace: fails if it is gone, counts it in flight
        (and its time in ``cpu_s``)."""
        with self._lock:
            if not self.alive:
                raise AgentError(f"workspace {self.id} is gone")
            self._inflight += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= 1
                self.cpu_s += time.perf_counter() - t0
        if not self.alive:
            raise AgentError(f"workspace {self.id} was removed during the call")

    def _quiet(self, what: str) -> FakeState:
        with self._lock:
            if not self.alive:
                raise StateConflict(f"workspace {self.id} is not running")
            if self._inflight:
                raise AgentError(f"{what} of {self.id} while a call is in flight: the dump would fail")
            return copy.deepcopy(self.state)

    def snapshot(self, *, mode: SnapshotMode | str = SnapshotMode.COW) -> FakeSnapshot:
        _check_mode(mode)
        state = self._quiet("snapshot")
        time.sleep(self.world.fork_s)
        self.world.bump("snapshot")
        return FakeSnapshot(self.world, state)

    def fork(self, n: int = 1, *, mode: SnapshotMode | str = SnapshotMode.COW) -> list[FakeWorkspace]:
        _check_mode(mode)
        state = self._quiet("fork")
        time.sleep(self.world.fork_s * (1 + n))
        self.world.bump("fork")
        return [FakeWorkspace(self.world, copy.deepcopy(state)) for _ in range(n)]

    def remove(self) -> None:
        with self._lock:
            self.alive = False
        self.world.live_workspaces.discard(self.id)

    def is_alive(self) -> bool:
        return self.alive

    def processes(self) -> list[ProcessInfo]:
        procs = ["agent", *(f"bash-{sid}" for sid, s in self.state.sessions.items() if s.alive), *self.state.procs]
        return [ProcessInfo(i + 1, 0, i + 1, i + 1, "S", p, (p,)) for i, p in enumerate(procs)]

    def set_cpu_priority(self, nice: int) -> None:
        if not 0 <= nice <= 19:
            raise InvalidArgument(f"nice {nice} is out of range", hint="give 0..19")
        self.cpu_nice = nice

    def stats(self) -> WorkspaceStats:
        size = self.state.size()
        return WorkspaceStats(self.id, MemoryStats(size, size, size, size), len(self.processes()), self.cpu_s)

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None, text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        return self.commands.run(command, timeout=timeout, cwd=cwd, env=env, stdin=stdin, text=text)


class FakeCommands:
    def __init__(self, ws: FakeWorkspace) -> None:
        self._ws = ws

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        with self._ws.in_call():
            line = command if isinstance(command, str) else shlex.join(command)
            sess = _Session(env=dict(env or {}), cwd=cwd or "/")
            out, code = _shell(self._ws, sess, line, timeout)
        # like the runtime: a timed-out command was SIGKILLed (exit code -9)
        status, signal = (-9, 9) if code is None else (code, None)
        if text:
            return ExecResult[str](status, signal, out, "", False, False, code is None, 0.0)
        return ExecResult[bytes](status, signal, out.encode(), b"", False, False, code is None, 0.0)

    def spawn(self, command: str | Sequence[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None) -> int:
        """Records the command as a background process (run nothing)."""
        with self._ws.in_call():
            line = command if isinstance(command, str) else shlex.join(command)
            self._ws.state.procs.append(line)
            return 100 + len(self._ws.state.procs)


class FakeFiles:
    def __init__(self, ws: FakeWorkspace) -> None:
        self._ws = ws

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        with self._ws.in_call():
            files = self._ws.state.files
            if path in files:
                data = files[path][offset:]
                return data if length is None else data[:length]
            if any(k.startswith(path.rstrip("/") + "/") for k in files):
                raise InvalidArgument(f"{path}: is a directory")
            raise PathNotFound(f"{path}: no such file or directory")

    def read_text(self, path: str) -> str:
        return self.read(path).decode()

    def write(self, path: str, data: bytes | str, *, mode: int | None = None) -> int:
        with self._ws.in_call():
            raw = data.encode() if isinstance(data, str) else data
            self._ws.state.files[path] = raw
            return len(raw)

    def list(self, path: str = "/") -> builtins.list[FileEntry]:
        with self._ws.in_call():
            prefix = path.rstrip("/") + "/"
            names = sorted({k[len(prefix):].split("/")[0] for k in self._ws.state.files if k.startswith(prefix)})
            out = []
            for name in names:
                full = prefix + name
                data = self._ws.state.files.get(full)
                kind = FileType.FILE if data is not None else FileType.DIR
                out.append(FileEntry(name, kind, len(data or b""), 0o644, 0.0))
            return out

    def remove(self, path: str, *, recursive: bool = False) -> None:
        with self._ws.in_call():
            if self._ws.state.files.pop(path, None) is None:
                raise PathNotFound(f"{path}: no such file or directory")


class FakeSessions:
    def __init__(self, ws: FakeWorkspace) -> None:
        self._ws = ws

    def list(self) -> builtins.list[SessionInfo]:
        with self._ws.in_call():
            return [SessionInfo(sid, "bash", i + 2, False, s.alive)
                    for i, (sid, s) in enumerate(self._ws.state.sessions.items())]

    def open(self, kind: str = "bash", *, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
        with self._ws.in_call():
            sid = f"s{len(self._ws.state.sessions) + 1}"
            self._ws.state.sessions[sid] = _Session(env=dict(env or {}), cwd=cwd or "/")
            return sid

    def close(self, session_id: str) -> None:
        with self._ws.in_call():
            self._ws.state.sessions.pop(session_id, None)

    def run(self, session_id: str, command: str, *, timeout: float | None = None,
            max_output: int | None = None) -> SessionResult:
        with self._ws.in_call():
            self._ws.world.bump("run")
            sess = self._ws.state.sessions[session_id]
            t0 = time.monotonic()
            out, code = _shell(self._ws, sess, command, timeout)
        return SessionResult(out, code, code is None, False, time.monotonic() - t0, sess.alive)


def _check_mode(mode: SnapshotMode | str) -> None:
    try:
        SnapshotMode(mode)
    except ValueError:
        raise InvalidArgument(f"unknown fork mode {mode!r}", hint="use one of cow, copy") from None


def _path(sess: _Session, p: str) -> str:
    return p if p.startswith("/") else (sess.cwd.rstrip("/") + "/" + p)


def _shell(ws: FakeWorkspace, sess: _Session, line: str, timeout: float | None) -> tuple[str, int | None]:
    """Run the tiny shell; returns (output, status) with status None on timeout."""
    out: list[str] = []
    code = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    files = ws.state.files
    for stmt in (s.strip() for s in line.split(";")):
        if not stmt:
            continue
        stmt = re.sub(r"\$(\w+)", lambda m: sess.env.get(m.group(1), ""), stmt)
        try:
            words = shlex.split(stmt)
        except ValueError as exc:
            return "".join(out) + f"fake: syntax error: {exc}\n", 2
        cmd, args = words[0], words[1:]
        code = 0
        if cmd == "export" or (re.match(r"^\w+=", cmd) and not args):
            for kv in (args if cmd == "export" else [cmd]):
                k, _, v = kv.partition("=")
                sess.env[k] = v
        elif cmd == "echo":
            out.append(" ".join(args) + "\n")
        elif cmd == "cd":
            sess.cwd = _path(sess, args[0]) if args else "/"
        elif cmd == "sleep":
            end = time.monotonic() + float(args[0])
            while time.monotonic() < end:
                if not ws.alive:
                    raise AgentError(f"workspace {ws.id} was removed during the call")
                if deadline is not None and time.monotonic() > deadline:
                    return "".join(out), None
                time.sleep(min(0.005, max(end - time.monotonic(), 0)))
        elif cmd == "cat":
            p = _path(sess, args[0])
            if p in files:
                out.append(files[p].decode())
            else:
                out.append(f"cat: {args[0]}: No such file or directory\n")
                code = 1
        elif cmd in ("write", "append"):
            p, text = _path(sess, args[0]), (" ".join(args[1:]) + "\n").encode()
            files[p] = (files.get(p, b"") if cmd == "append" else b"") + text
        elif cmd == "rm":
            code = 0 if files.pop(_path(sess, args[0]), None) is not None else 1
        elif cmd == "ls":
            prefix = sess.cwd.rstrip("/") + "/"
            names = sorted({k[len(prefix):].split("/")[0] for k in files if k.startswith(prefix)})
            out.append("".join(n + "\n" for n in names if not n.startswith(".")))
        elif cmd == "inc":
            p = _path(sess, args[0])
            number = files.get(p, b"0").decode().strip() or "0"
            if not number.isdigit():
                out.append(f"inc: {args[0]}: not a number\n")
                code = 1
                continue
            files[p] = str(int(number) + 1).encode()
            out.append(f"{int(number) + 1}\n")
        elif cmd == "random":
            out.append(f"{random.random()}\n")
        elif cmd == "bg":
            ws.state.procs.append(args[0])
        elif cmd == "env":
            out.append(json.dumps(sess.env, sort_keys=True) + "\n")
        elif cmd == "exit":
            return "".join(out), int(args[0]) if args else 0
        elif cmd in ws.world.commands:
            extra, code = ws.world.commands[cmd](ws, args)
            out.append(extra)
        else:
            out.append(f"fake: {cmd}: command not found\n")
            code = 127
    return "".join(out), code


def _conforms(ws: FakeWorkspace, snap: FakeSnapshot) -> tuple[WorkspaceAPI, SnapshotAPI]:
    """Never called: mypy checks here that the fakes satisfy the protocols."""
    return ws, snap
