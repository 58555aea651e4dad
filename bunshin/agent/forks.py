"""The agent's helper processes: forking one, its sockets, and ending them all.

The agent answers no request itself: each connection is served by a worker
forked for it (``server``), and what outlives a call (a job, a session) lives in
a process of its own (``jobs``, ``sessions``), reached over a unix socket in the
run folder. In a forked clone every page a call writes is then copied into a
process that exits with the call, not into the long-lived agent (whose Python
heap is shared copy-on-write with the snapshot).

A helper is forked from a single-threaded process (the agent, a worker before it
starts a thread, a session before its first run), so no lock is held across the
fork. It resets the agent's signal dispositions (the agent ignores ``SIGCHLD``
so that the kernel reaps its children and orphans) and ends with ``os._exit``:
no atexit handler, no finaliser, no flush of what it inherited.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from . import procfs
from .protocol import unix_address
from .wire import LineReader

_PR_SET_CHILD_SUBREAPER = 36
#: How often ``kill_tree`` looks again for what was reparented meanwhile.
_KILL_ROUNDS = 20


def _prctl() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return fn


_PRCTL = _prctl()


def become_reaper() -> None:
    """Let the kernel reap every child and orphan (``SIGCHLD`` ignored), and take
    orphans of descendants (subreaper: when the agent is not pid 1, as in tests)."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    become_subreaper()


def become_subreaper() -> None:
    """Take the orphans of descendants (as pid 1 the agent does anyway)."""
    if _PRCTL is not None and os.getpid() != 1:
        _PRCTL(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
               ctypes.c_ulong(0))


def fork(name: str) -> int:
    """``os.fork``; in the child, reset the signals and name the process ``name``
    (``/proc/PID/comm``). ``OSError`` (EAGAIN: the pids limit) if none can start."""
    pid = os.fork()
    if pid == 0:
        as_helper(name)
    return pid


#: The names (``/proc/PID/comm``) of the agent's helpers.
WORKER, JOB, SESSION = "bunshin-worker", "bunshin-job", "bunshin-session"
HELPERS = frozenset({WORKER, JOB, SESSION})


def as_helper(name: str) -> None:
    """In a just-forked child: ``SIGCHLD`` back to its default (``subprocess`` waits for its
    children), and the name ``name``. Plain system calls only: in a forked clone each page
    this writes is copied on write, on the path of every call."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    set_name(name)
    _set_cmdline(name)


def set_name(name: str) -> None:
    """``/proc/PID/comm`` of the calling thread (the process's when it is the main one)."""
    try:
        fd = os.open("/proc/thread-self/comm", os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(fd, name.encode()[:15])
    except OSError:
        pass
    finally:
        os.close(fd)


def _set_cmdline(name: str) -> None:
    """Write ``name`` over the argument area the kernel shows as ``/proc/PID/cmdline``
    (Python keeps its own copy of argv): a ``pkill -f bunshin_agent`` from inside, which
    pid 1 ignores, does not find the helpers either."""
    try:
        fd = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        fields = raw[raw.rfind(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        if end <= start:
            return
        data = name.encode()[: end - start - 1]
        fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            os.pwrite(fd, data + bytes(end - start - len(data)), start)
        finally:
            os.close(fd)
    except (OSError, IndexError, ValueError):
        return


def keep_only(*keep: int) -> None:
    """Close every descriptor but stdin/out/err and ``keep``: a helper that outlives the
    call that forked it must not hold that call's connection (the host's peer: CRIU
    cannot dump it) or anything else the call had open."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already


def run_and_exit(body: Callable[[], object]) -> NoReturn:
    """Run ``body`` in a forked helper and end the process (status 1 if it raised)."""
    code = 0
    try:
        body()
    except BaseException:  # noqa: BLE001 - a helper reports and ends, whatever happened
        traceback.print_exc(file=sys.stderr)
        code = 1
    finally:
        os._exit(code)


def listen_at(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (mode 0600, replacing a stale one)."""
    if os.path.lexists(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    address, dir_fd = unix_address(path)
    old_umask = os.umask(0o177)
    try:
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
        if dir_fd is not None:
            os.close(dir_fd)
    sock.listen(64)
    return sock


def ask(path: str, line: bytes, timeout: float | None) -> bytes:
    """Send one request line to the helper listening at ``path``; its answer line.

    ``FileNotFoundError`` / ``ConnectionRefusedError``: nobody listens there
    (the helper ended); ``ConnectionError`` if it hung up before answering.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        address, dir_fd = unix_address(path)
        try:
            sock.connect(address)
        finally:
            if dir_fd is not None:
                os.close(dir_fd)
        sock.sendall(line)
        answer = LineReader(sock.recv, limit=None).readline()
    if answer is None:
        raise ConnectionError(f"{os.path.basename(path)} ended before answering")
    return answer + b"\n"


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for pid in procfs.pids():
        stat = procfs.read_stat(pid)
        if stat is not None:
            children.setdefault(stat.ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def kill_tree(root: int) -> None:
    """SIGKILL everything below ``root``, also what is reparented to it meanwhile
    (a killed session's shell comes to the agent, its subreaper)."""
    for _ in range(_KILL_ROUNDS):
        pids = descendants(root)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
