"""criu processes started by a small helper kept warm, not forked from the caller.

``subprocess`` with a ``preexec_fn`` (the ``criu.Placement`` must run between fork and
exec) cannot use vfork: every criu run forked the whole calling process, ~4 ms here
for a test process and more for a server or a bench holding 1,024 clones (page tables
of all its memory, every thread's state). ``CriuLauncher`` starts ``zygote.py`` once
per process (standard library only, ~10 MiB) and asks it over a socketpair to fork
and exec each criu run: the fork is of the small helper.

One launcher per process (``launcher()``), started on first use, restarted after a
``fork`` of the caller (the child gets its own) or when the helper died. The helper
ends with its caller (its socket closes), so nothing outlives the process for ``gc``
to find. If it cannot be started, ``launcher()`` is None and criu runs through
``subprocess`` as before.
"""

from __future__ import annotations

import array
import contextlib
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..kernel import syscalls as sc
from . import launch as criu_launch
from . import restore_boost

ZYGOTE = Path(__file__).with_name("zygote.py")
START_TIMEOUT_S = 10.0
MAX_TREES = 32  # mounts one request may carry to its namespace (zygote.MAX_FDS bounds all)


class LaunchError(OSError):
    """The helper could not start the command (placement or exec failed), or is gone."""


@dataclass
class _Pending:
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    pid: int | None = None
    status: int | None = None
    error: str | None = None
    rpc: socket.socket | None = None  # a warm criu's RPC socket (``start_rpc``)
    pidfd: int = -1  # and its pidfd (the caller's to close)


class CriuLauncher:
    """The calling process's end of one ``zygote.py`` helper."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc, self._sock = proc, sock
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="bunshin-criu-launcher", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls) -> CriuLauncher:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", str(ZYGOTE), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, env=criu_launch.env(),  # what it runs is criu: its environment
            )
        finally:
            theirs.close()
        mine.set_inheritable(False)
        return cls(proc, mine)

    @property
    def pid(self) -> int:
        """The helper's pid."""
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return not self._dead and self._proc.poll() is None

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # it hands each answer to a waiting restore (``restore_boost``)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), restore_boost.THREAD_NICE)
        while True:
            fds = array.array("i")
            try:
                data, anc, _, _ = self._sock.recvmsg(1 << 16, socket.CMSG_SPACE(4 * fds.itemsize))
            except OSError:
                data, anc = b"", []
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
            if not data:
                break
            msg = json.loads(data)
            with self._lock:
                p = self._pending.get(msg["id"])
            if p is None or (msg.get("rpc") and len(fds) != 2):
                for fd in fds:
                    os.close(fd)
                continue
            if msg.get("rpc"):
                p.rpc, p.pidfd = socket.socket(fileno=fds[0]), fds[1]
            if "error" in msg:
                p.error = msg["error"]
                p.started.set()
                p.ended.set()
            elif "status" in msg:
                p.status = msg["status"]
                p.ended.set()
            else:
                p.pid = msg["pid"]
                p.started.set()
        self._dead = True
        with self._lock:
            for p in self._pending.values():
                if p.error is None and p.status is None:
                    p.error = p.error or "the criu launcher ended"
                p.started.set()
                p.ended.set()

    def spawn(self, argv: list[str], placement: dict[str, Any], out_fd: int,
              pass_fd: int | None = None, *, rpc: bool = False) -> tuple[int, _Pending]:
        """Start ``argv`` with stdout and stderr on ``out_fd`` after ``placement`` (and
        ``pass_fd`` as its descriptor ``zygote.PASSED_FD``); its pid. ``rpc``: ``argv`` is a
        ``criu swrk`` the helper keeps exec'd ahead (``start_rpc``); ``LaunchError`` if it
        cannot give one."""
        rid = next(self._ids)
        p = _Pending()
        with self._lock:
            self._pending[rid] = p
        trees = clone_trees(placement.get("own_mounts") or [])
        if trees is None and rpc:
            self.forget(rid)
            raise LaunchError("NoWarmCriu: the restore's mounts cannot be copied")
        if trees is None:  # the command runs in the host's namespace instead
            placement, trees = {**placement, "own_mounts": []}, []
        msg = json.dumps({"id": rid, "argv": argv, "placement": placement, "pass_fd": pass_fd is not None,
                          "rpc": rpc}).encode()
        passed = [] if pass_fd is None else [pass_fd]
        try:
            self._sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [out_fd, *trees, *passed]))])
        except OSError as e:
            self.forget(rid)
            raise LaunchError(f"the criu launcher is gone: {e}") from e
        finally:
            for fd in trees:
                os.close(fd)
        p.started.wait()
        if p.error is not None or p.pid is None:
            self.forget(rid)
            raise LaunchError(p.error or "the criu launcher gave no pid")
        return rid, p

    def wait(self, rid: int, p: _Pending, timeout: float | None = None) -> int | None:
        """The exit code (``-signal`` if killed), or None if it still runs after ``timeout``."""
        if not p.ended.wait(timeout):
            return None
        self.forget(rid)
        if p.status is None:
            raise LaunchError(p.error or "the criu launcher ended before its child")
        return os.waitstatus_to_exitcode(p.status)

    def forget(self, rid: int) -> None:
        with self._lock:
            self._pending.pop(rid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the helper sees EOF
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(START_TIMEOUT_S)


def clone_trees(wanted: list[Any]) -> list[int] | None:
    """A detached copy of each ``(path, recursive)`` mount (``syscalls.clone_tree``), for a
    command's namespace of its own; None if any cannot be made (or too many are wanted)."""
    if len(wanted) > MAX_TREES:
        return None
    fds: list[int] = []
    try:
        for path, recursive in wanted:
            fds.append(sc.clone_tree(str(path), recursive=bool(recursive)))
    except OSError:
        for fd in fds:
            os.close(fd)
        return None
    return fds


_launcher: CriuLauncher | None = None
_owner = 0
_failed = False
_global = threading.Lock()


def launcher() -> CriuLauncher | None:
    """This process's launcher (started on first use); None if it cannot run here."""
    global _launcher, _owner, _failed
    with _global:
        if _owner != os.getpid():  # a forked child: the parent's helper is not ours
            _launcher, _owner, _failed = None, os.getpid(), False
        if _launcher is not None and not _launcher.alive:
            _launcher.close()
            _launcher = None
        if _launcher is None and not _failed:
            try:
                _launcher = CriuLauncher.start()
            except OSError:
                _failed = True
        return _launcher


def placement_fields(placement: Any) -> dict[str, Any]:
    """A ``criu.Placement`` as the helper takes it (its fields are plain values and tuples of
    them: read as they are, not deep-copied as ``dataclasses.asdict`` does)."""
    if placement is None:
        return {}
    return {f.name: (list(v) if isinstance(v := getattr(placement, f.name), tuple) else v)
            for f in fields(placement)}


@dataclass
class Started:
    """A command the launcher started: its pid (its own until ``wait`` has seen it end)."""

    pid: int
    _launcher: CriuLauncher
    _rid: int
    _pending: _Pending

    def wait(self, timeout: float | None = None) -> int | None:
        """Its exit code (``-signal`` if killed), or None if it still runs after ``timeout``."""
        return self._launcher.wait(self._rid, self._pending, timeout)

    def kill(self) -> None:
        """SIGKILL it unless it has ended (its helper reaps it only then: the pid is still its own)."""
        if not self._pending.ended.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, 9)

    def gone(self, timeout: float | None = None) -> bool:
        """A warm criu's (``start_rpc``): wait until it has exited, through its pidfd, without
        the helper's report (which ``wait`` gives, with the exit code); False on timeout.
        Its pidfd is closed then, and the launcher forgets it."""
        fd = self._pending.pidfd
        if fd < 0:
            return self.wait(timeout) is not None
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(None if timeout is None else int(timeout * 1000)):
            return False
        os.close(fd)
        self._pending.pidfd = -1
        self._launcher.forget(self._rid)
        return True

    def close(self) -> None:
        """Close what the launcher handed over (the pidfd of a warm criu), if still open."""
        if self._pending.pidfd >= 0:
            os.close(self._pending.pidfd)
            self._pending.pidfd = -1


def start(argv: list[str], placement: Any, out_fd: int, pass_fd: int | None = None) -> Started | None:
    """Start ``argv`` through the launcher (``pass_fd`` becomes its ``zygote.PASSED_FD``)
    without waiting for it; None when there is no launcher (the caller starts it itself).
    Raises ``FileNotFoundError`` when the program is missing, ``LaunchError`` when the
    placement failed."""
    lch = launcher()
    if lch is None:
        return None
    try:
        rid, pending = lch.spawn(argv, placement_fields(placement), out_fd, pass_fd)
    except LaunchError as e:
        if str(e).startswith("FileNotFoundError") and not os.path.exists(argv[0]):
            raise FileNotFoundError(argv[0]) from e
        raise
    assert pending.pid is not None
    return Started(pending.pid, lch, rid, pending)


def rpc_fits(placement: Any) -> bool:
    """Whether a warm criu (``start_rpc``) can take ``placement``: a fresh network namespace
    and keyring, the restore's own mounts (its sysfs and cgroups are given from outside),
    nothing joined and no namespace held on the host."""
    joined = ("netns", "timens", "utsns", "ipcns")  # namespaces a placement may name to join
    return (placement is not None and getattr(placement, "owner", None) is None and placement.new_netns and placement.own_keyring and bool(placement.own_mounts)
            and all(getattr(placement, k, None) is None for k in joined) and not placement.hold_netns)


def start_rpc(argv: list[str], placement: Any, out_fd: int) -> tuple[Started, socket.socket] | None:
    """A ``criu swrk`` the launcher keeps exec'd ahead (``argv`` ends with its socket's fd,
    ``zygote.PASSED_FD``), given ``placement`` (``rpc_fits``) and handed over: it and the
    caller's end of its RPC socket. None when there is no launcher. ``LaunchError`` when no
    warm one can be had (the caller runs criu the usual way)."""
    lch = launcher()
    if lch is None:
        return None
    rid, pending = lch.spawn(argv, placement_fields(placement), out_fd, rpc=True)
    assert pending.pid is not None
    if pending.rpc is None:
        raise LaunchError("the criu launcher gave no RPC socket")
    return Started(pending.pid, lch, rid, pending), pending.rpc


def run(argv: list[str], placement: Any, out_fd: int, timeout: float | None) -> tuple[int, bool] | None:
    """Run ``argv`` through the launcher and wait: (exit code, whether ``timeout`` killed it).

    None when there is no launcher (the caller runs it itself). Raises
    ``FileNotFoundError`` when the program is missing, ``LaunchError`` when the
    placement failed; on an interrupt the child is killed and awaited.
    """
    child = start(argv, placement, out_fd)
    if child is None:
        return None
    try:
        code = child.wait(timeout)
        if code is not None:
            return code, False
        child.kill()
        code = child.wait()
        return (code if code is not None else -9), True
    except BaseException:
        child.kill()
        child.wait()
        raise
