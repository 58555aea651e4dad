"""Paths resolved as the kernel does, one component at a time, without the agent's standing.

The agent is pid 1 and keeps a capability nothing else inside has (``caps.PID1_ONLY_CAP``):
the kernel lets it open its own ``/proc/1/{environ,mem,maps,fd/*,root,...}`` (its own thread
group always may), and those of its helpers (``--calls fork``: workers, jobs, session
holders), which processes inside are refused (EACCES: a target's permitted capabilities must
be a subset of the opener's). A file call must not lend that standing: the walk refuses any
path that reaches such a process's ``/proc/PID`` directory, however it gets there
(``/proc/self``, ``/proc/thread-self``, ``/proc/PID/task/TID``, a symlink or ``..`` into
``/proc``, another process's ``fd/N`` or ``cwd`` link pointing at it).

Each component is opened ``O_PATH | O_NOFOLLOW`` below the last; a symlink outside ``/proc``
is read and its target walked the same way (every folder on the way checked); a link of
procfs (``self``, ``fd/N``, ``cwd``, ``root``, ...: magic links have no path to read) is
followed by the kernel one hop, and where it lands is checked by the path procfs gives it
(``/proc/self/fd/N``). The caller opens what the walk returns through its descriptor, so
nothing a process inside swaps in meanwhile is followed.

A path without any symlink (most are) takes one ``openat2(RESOLVE_NO_SYMLINKS)`` of its
folder instead (``_plain``): with no link on the way, what it names is what it spells, so
its normalised text says whether it is under an agent's ``/proc/PID``. A walk of a depth-6
path costs ~35 us in Python, the plain way ~8 us (one call to the agent: ~300-600 us).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat
from collections.abc import Callable
from typing import NamedTuple

from .caps import DROPPED_CAPS, PID1_ONLY_CAP
from .protocol import AgentFailure, ErrorCode

_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's MAXSYMLINKS
_AGENT_CAP = 1 << DROPPED_CAPS[PID1_ONLY_CAP]
_SYS_OPENAT2 = 437  # x86_64
_RESOLVE_NO_SYMLINKS = 0x04  # no symlink of any kind, magic links included


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> Callable[..., int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_long
    return call


_SYSCALL = _load_syscall()
_PLAIN_OK = [_SYSCALL is not None]  # cleared if the kernel has no openat2 (ENOSYS: before 5.6)


class Walked(NamedTuple):
    """Where a path led: its folder and its object (``O_PATH`` descriptors; ``obj`` is -1 if
    the last name does not exist), and that name. ``close()`` releases both."""

    parent: int
    obj: int
    name: str

    def close(self) -> None:
        for fd in {self.parent, self.obj} - {-1}:
            os.close(fd)

    def reopen(self, flags: int, mode: int = 0o644) -> int:
        """A descriptor of the object (created in ``parent`` if it does not exist, never
        through a symlink put there since)."""
        if self.obj >= 0:
            return os.open(f"/proc/self/fd/{self.obj}", flags | os.O_CLOEXEC, mode)
        return os.open(self.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.parent)


def walk(path: str, *, follow_last: bool = True) -> Walked:
    """Resolve absolute ``path``; ``AgentFailure`` if it reaches the agent's ``/proc`` entries,
    ``OSError`` as the kernel would fail (ENOENT for a missing folder, ELOOP, ENOTDIR, ...)."""
    plain = _plain(path, follow_last) if _PLAIN_OK[0] else None
    if plain is not None:
        return plain
    proc_dev = os.stat("/proc").st_dev
    parts = [p for p in path.split("/") if p][::-1]  # a stack: the next component last
    cur = os.open("/", _PATH | os.O_DIRECTORY)
    links = 0
    try:
        while parts:
            name = parts.pop()
            try:
                nxt = os.open(name, _PATH, dir_fd=cur)
            except FileNotFoundError:
                if parts:
                    raise
                return Walked(cur, -1, name)
            st = os.fstat(nxt)
            if stat.S_ISLNK(st.st_mode) and (parts or follow_last):
                links += 1
                if links > _MAX_LINKS:
                    os.close(nxt)
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                if st.st_dev != proc_dev:
                    target = os.readlink(name, dir_fd=cur)
                    os.close(nxt)
                    if target.startswith("/"):
                        os.close(cur)
                        cur = os.open("/", _PATH | os.O_DIRECTORY)
                    parts += [p for p in target.split("/") if p][::-1]
                    continue
                os.close(nxt)
                nxt = os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=cur)  # the kernel follows it
                st = os.fstat(nxt)
            if st.st_dev == proc_dev:
                _refuse_agent_entry(nxt, path)
            if not parts:
                return Walked(cur, nxt, name)
            os.close(cur)
            cur = nxt
        return Walked(cur, os.dup(cur), "/")  # "/" itself (or only "." and ".." of it)
    except BaseException:
        os.close(cur)
        raise


def check(path: str) -> None:
    """``AgentFailure`` if ``path`` leads into the agent's ``/proc`` entries (a command's
    working folder, which its child enters before it drops the agent's capability);
    other errors are left to the caller's own use of the path."""
    try:
        walk(path).close()
    except OSError:
        pass


def _plain(path: str, follow_last: bool) -> Walked | None:
    """``walk`` of a path with no symlink on the way, or ``None`` (a link, a name under an
    agent's ``/proc/PID``, an error: the walk proper decides and says why)."""
    spelled = posixpath.normpath(path)
    if spelled.startswith("/proc/") and _under_agent(spelled.split("/")):
        return None
    folder, name = posixpath.split(path.rstrip("/")) if path.rstrip("/") else ("/", "")
    how = _OpenHow(os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS)
    assert _SYSCALL is not None
    parent = _SYSCALL(_SYS_OPENAT2, -100, os.fsencode(folder or "/"), ctypes.byref(how), ctypes.sizeof(how))
    if parent < 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _PLAIN_OK[0] = False
        return None
    if not name:
        return Walked(parent, os.dup(parent), "/")
    try:
        obj = os.open(name, _PATH, dir_fd=parent)
    except FileNotFoundError:
        return Walked(parent, -1, name)
    except OSError:
        os.close(parent)
        return None
    if name == ".." or (follow_last and stat.S_ISLNK(os.fstat(obj).st_mode)):
        os.close(obj)  # ".." of the folder: its own path is not the one spelled; a link: walk it
        os.close(parent)
        return None
    return Walked(parent, obj, name)


def _under_agent(where: list[str]) -> bool:
    """Whether ``/proc/...`` split at its slashes is in an agent's ``/proc/PID`` (or its task)."""
    numbers = where[2:3] + (where[4:5] if where[3:4] == ["task"] else [])  # PID, TID
    return any(n.isdigit() and _agents(int(n)) for n in numbers)


def _refuse_agent_entry(fd: int, path: str) -> None:
    """Refuse ``fd`` if it is in the ``/proc/PID`` (or ``/proc/PID/task/TID``) folder of the
    agent or of a process holding the agent's capability (its helpers)."""
    try:
        where = os.readlink(f"/proc/self/fd/{fd}").split("/")
    except OSError:
        return
    if where[1:2] != ["proc"]:
        return
    numbers = where[2:3] + (where[4:5] if where[3:4] == ["task"] else [])  # PID, TID
    for pid in (int(n) for n in numbers if n.isdigit()):
        if _agents(pid):
            os.close(fd)
            raise AgentFailure(
                ErrorCode.INVALID_ARGUMENT,
                f"{path}: permission denied (it leads to /proc/{pid}, the workspace agent's own: "
                "file calls do not lend the agent's standing, and processes inside are refused its "
                "environ, memory and descriptors)",
                hint="read what a process inside may read with a command, e.g. exec cat /proc/1/status",
            )


def _agents(pid: int) -> bool:
    """Whether ``pid`` is a thread of the agent or a process holding its capability."""
    if pid == os.getpid() or os.path.lexists(f"/proc/self/task/{pid}"):
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"CapPrm:"):
                    return bool(int(line.split()[1], 16) & _AGENT_CAP)
    except (OSError, ValueError, IndexError):
        pass
    return False
