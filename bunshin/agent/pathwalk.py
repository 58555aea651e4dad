"""Paths resolved as the kernel does, one component at a time, without the agent's standing.

The agent is pid 1 and keeps a capability nothing else inside has (``children.PID1_ONLY_CAP``):
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
"""

from __future__ import annotations

import errno
import os
import stat
from typing import NamedTuple

from .children import DROPPED_CAPS, PID1_ONLY_CAP
from .protocol import AgentFailure, ErrorCode

_PATH = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's MAXSYMLINKS
_AGENT_CAP = 1 << DROPPED_CAPS[PID1_ONLY_CAP]


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
