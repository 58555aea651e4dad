"""Starting children and reaping them: one reaper thread owns every ``wait``.

The agent may be PID 1, so it must also reap orphans it never started. One
thread waits for any child and hands each exit status to the ``Child`` that was
registered under that pid; statuses of unknown pids (orphans) are dropped.

Races avoided:
- a child that exits before it is registered: ``start`` holds the registry lock
  from the fork until the registration, and the reaper takes the same lock
  before it reaps, so it always finds the child;
- pid reuse: the reaper first *peeks* at a zombie (``WNOWAIT``), then reaps it
  under the lock; while the zombie exists its pid cannot be handed out again.

Children are started by ``spawn`` (``fork_exec`` without ``Popen``, whose objects
would be copied into a forked clone by its first call); only the reaper waits.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import pathwalk, spawn
from .caps import DROPPED_CAPS, PID1_ONLY_CAP  # noqa: F401 - also runtime.init's
from .imagedefaults import IMAGE, Identity
from .pool import Flag
from .protocol import AgentFailure, cannot_start, from_os_error, invalid
from .wire import ErrorCode

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
}

_PR_CAPBSET_DROP = 24


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a child: a clean base (an image's: ``imagedefaults``) plus what
    the request gives."""
    if IMAGE is not None:
        return {**IMAGE.environment(IMAGE.identity()), **extra}
    return {**BASE_ENV, **extra}


def default_cwd(env: dict[str, str]) -> str:
    if IMAGE is not None:  # WorkingDir; made (by root, as docker does) when the image lacks it
        try:
            os.makedirs(IMAGE.cwd, exist_ok=True)
        except OSError:
            pass  # check_cwd says what is wrong
        return IMAGE.cwd
    home = env.get("HOME", "/")
    return home if os.path.isdir(home) else "/"


def check_cwd(cwd: str) -> None:
    pathwalk.check(cwd)
    try:
        is_dir = os.path.isdir(cwd)
        exists = is_dir or os.path.lexists(cwd)
    except OSError as exc:
        raise from_os_error(exc, f"cwd {cwd}") from None
    if not exists:
        raise AgentFailure(ErrorCode.PATH_NOT_FOUND, f"cwd {cwd}: no such directory")
    if not is_dir:
        raise invalid(f"cwd {cwd}: not a directory")


def _start_error(exc: OSError, program: str, cwd: str, env: dict[str, str]) -> AgentFailure:
    if exc.errno in (errno.EAGAIN, errno.ENOMEM) and exc.filename is None:
        return cannot_start(program, exc.strerror)
    if exc.filename == cwd and program != cwd:
        return from_os_error(exc, f"cwd {cwd}")
    if isinstance(exc, FileNotFoundError):
        where = "" if "/" in program else f" in PATH={env.get('PATH', '')}"
        return AgentFailure(ErrorCode.PATH_NOT_FOUND, f"executable not found: {program}{where}")
    reason = "permission denied" if isinstance(exc, PermissionError) else exc.strerror or str(exc)
    return invalid(f"cannot execute {program}: {reason}")


def _load_prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        print("bunshin-agent: prctl unavailable, capabilities not dropped", file=sys.stderr)
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()
_CAPS = tuple(DROPPED_CAPS.values())


def _child_setup(controlling_tty: bool, ident: Identity | None = None) -> Callable[[], None]:
    """The code run in the child between fork and exec (after ``setsid``).

    It must not take locks or import: errors (EINVAL for caps the kernel lacks, EPERM
    without CAP_SETPCAP) are ignored. ``ident`` (an image's non-root user): ids are
    changed after the bounding set is dropped; a failure there raises, and the child
    never runs the command (``Popen`` reports it).
    """
    prctl = _PRCTL

    def setup() -> None:
        if prctl is not None:
            for cap in _CAPS:
                prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
        if controlling_tty:
            try:
                fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            except OSError:
                pass
        if ident is not None:
            os.setgroups(list(ident.groups))
            os.setresgid(ident.gid, ident.gid, ident.gid)
            os.setresuid(ident.uid, ident.uid, ident.uid)

    return setup


class Child:
    """A process started by the agent. Its status arrives from the reaper."""

    def __init__(self, pid: int, stdin: spawn.Stream | None = None, stdout: spawn.Stream | None = None,
                 stderr: spawn.Stream | None = None) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.status: int | None = None  # raw wait status
        self._done = Flag()
        self._callbacks: list[Callable[[Child], None]] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reaper has seen this child exit; False on timeout."""
        return self._done.wait(timeout)

    @property
    def exit_code(self) -> int | None:
        """Exit status, or minus the signal number (like ``Popen.returncode``)."""
        return None if self.status is None else os.waitstatus_to_exitcode(self.status)

    @property
    def signal(self) -> int | None:
        if self.status is None or not os.WIFSIGNALED(self.status):
            return None
        return os.WTERMSIG(self.status)

    def on_exit(self, callback: Callable[[Child], None]) -> None:
        """Call ``callback(child)`` once the child has exited (now if it has)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def finish(self, status: int) -> None:
        """Record the exit ``status`` and run the exit callbacks (the reaper calls it once)."""
        with self._lock:
            self.status = status
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception as exc:  # a callback must not kill the reaper
                print(f"bunshin-agent: exit callback failed: {exc!r}", file=sys.stderr)


class Reaper:
    """Registry of children plus the one thread that waits for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: dict[int, Child] = {}
        self._spawned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)

    def start_thread(self) -> None:
        self._thread.start()

    def live(self) -> list[Child]:
        with self._lock:
            return list(self._children.values())

    def start(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        stdin: Any = subprocess.DEVNULL,
        stdout: Any = subprocess.DEVNULL,
        stderr: Any = subprocess.DEVNULL,
        controlling_tty: bool = False,
    ) -> Child:
        """Start ``argv`` in a new session, capabilities dropped; register it.

        Raises ``AgentFailure`` (path_not_found / invalid_argument) when the
        program or the directory cannot be used.
        """
        check_cwd(cwd)
        ident = IMAGE.identity() if IMAGE is not None else None
        with self._lock:
            try:
                pid, *streams = spawn.start(argv, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr,
                                            preexec_fn=_child_setup(controlling_tty, ident))
            except OSError as exc:
                raise _start_error(exc, argv[0], cwd, env) from None
            except subprocess.SubprocessError as exc:  # ``ident``'s ids refused
                raise invalid(f"cannot run {argv[0]} as the image's user {IMAGE.user if IMAGE else ''}: "
                              f"{exc}") from None
            child = Child(pid, *streams)
            self._children[child.pid] = child
        self._spawned.set()
        return child

    def _run(self) -> None:
        while True:
            self._spawned.clear()
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                self._spawned.wait(1.0)
                continue
            if info is None:
                continue
            with self._lock:
                try:
                    pid, status = os.waitpid(info.si_pid, os.WNOHANG)
                except ChildProcessError:
                    continue  # reaped elsewhere (spawn.start after a failed exec)
                child = self._children.pop(pid, None) if pid else None
            if child is not None:
                child.finish(status)

    def kill_all(self) -> None:
        """SIGKILL every live child's process group (agent shutdown)."""
        for child in self.live():
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except OSError:
                pass
