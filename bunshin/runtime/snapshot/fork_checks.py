"""What CRIU cannot carry across a fork, refused before the dump.

CRIU reports these late (after the workspace was frozen) or cryptically; each is
found here by reading ``/proc`` of the workspace's processes, before anything is
frozen or written, and raised as ``NotForkable`` naming the process (its pid inside
the workspace and its command), the object and what to do:

- a zombie thread-group leader whose other threads still run (the main thread
  called ``pthread_exit``, ZDTM pthread02): CRIU cannot seize it ("Unable to detach
  from PID: No such process").
- a process traced by another (strace, gdb): CRIU must seize it with ptrace itself
  ("Unseizable non-zombie PID found").
- a descriptor of a kind CRIU has no dumper for: an anonymous inode other than
  eventfd, epoll, inotify, fanotify, signalfd, timerfd, pidfd (a Landlock ruleset:
  "Can't dump file 3 of that type"), and secret memory (``memfd_secret``, its
  descriptor or mapping: "Unknown shit 100600 (/secretmem (deleted))").
- a namespace of its own other than a mount or network one (ipc, uts, pid, cgroup,
  time, user; also one made for its children only): CRIU dumps nested namespaces of
  those kinds not at all ("Can't dump nested ipc namespace", Firefox's sandbox). A
  workspace cannot make one today (no CAP_SYS_ADMIN inside, new user namespaces
  refused by seccomp); the check keeps a fork from failing late if that changes.
- an inotify watch on a file or folder that was deleted while something of the
  workspace holds it (an open descriptor, a working directory, a mapping: else the
  kernel drops the watch with the inode): CRIU records a watch by a path and has
  none for it (the dump fails, "Can't dump that handle", or the restore does,
  "fsnotify: Unable to open (null)").

TCP connections fork (``netns_image``: a clone's network namespace is its user
namespace's, where CRIU's restorer may repair them); listening sockets always did.

Measured cost, with the tree walk: 4.1 ms p50, 8.1 ms p95 for a workspace of six
processes (2-core VM at load 5); it runs before the dump, so the pause is unchanged. The state can change between the check and the freeze; a descriptor
opened in that window still fails the restore, with CRIU's first error.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import NotForkable
from ..kernel import mountinfo

# Namespaces CRIU cannot dump when a process has its own (CLONE_SUBNS are the others)
NESTED_NS = ("ipc", "uts", "pid", "cgroup", "time", "user")
# ... and the ones a process sets for its children: equal to its own unless it unshared
FOR_CHILDREN = {"pid_for_children": "pid", "time_for_children": "time"}
# Anonymous-inode descriptors CRIU 4.2 dumps (criu/files.c); any other kind fails the dump
ANON_INODES = {"[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]", "bpf-map"}
SECRETMEM = "/secretmem"  # what memfd_secret's descriptors and mappings are called
_WATCH = re.compile(r"^inotify wd:\S+ ino:([0-9a-f]+) sdev:([0-9a-f]+) ", re.M)
_DELETED = " (deleted)"


@dataclass(frozen=True)
class Task:
    """A process of the workspace as its owner knows it."""

    host_pid: int
    pid: int  # inside the workspace's pid namespace
    command: str

    @classmethod
    def read(cls, host_pid: int, level: int, proc: Path = Path("/proc")) -> Task:
        """``level``: the depth of the workspace's pid namespace (its init's, ``_level``)."""
        base = proc / str(host_pid)
        inside = host_pid
        with contextlib.suppress(OSError, ValueError, IndexError):
            inside = _nspids(host_pid, proc)[level]
        command = _command(base)
        # the workspace wrote it: no control characters into messages and terminals
        command = "".join(c if c.isprintable() else "?" for c in command)
        return cls(host_pid=host_pid, pid=inside, command=command[:120])


def _command(base: Path) -> str:
    """The process's command line; a zombie thread-group leader has none of its own (its
    memory went with its main thread), so a live thread's (they share it); else its name
    (``[comm]``, which a program may set empty: ``prctl(PR_SET_NAME, "")``); never empty."""
    tasks: list[str] = []
    with contextlib.suppress(OSError):
        tasks = [t for t in os.listdir(base / "task") if t != base.name]
    for cmdline in [base / "cmdline", *(base / "task" / t / "cmdline" for t in tasks)]:
        with contextlib.suppress(OSError):
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if command:
                return command
    with contextlib.suppress(OSError):
        name = (base / "comm").read_text().strip()
        if name:
            return f"[{name}]"
    return "no command line or name"


def pid_level(init: int, proc: Path = Path("/proc")) -> int:
    """The depth of the workspace's pid namespace (its init ``init``'s, the host's being 0)."""
    return len(_nspids(init, proc)) - 1


def _nspids(pid: int, proc: Path) -> list[int]:
    """The process's pid in each pid namespace it is in, the host's first (``NSpid``)."""
    for line in (proc / str(pid) / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return [pid]


@dataclass(frozen=True)
class Refusal:
    """One thing that cannot be forked: who holds it, what it is, what to do."""

    task: Task
    what: str
    why: str
    hint: str

    def message(self, workspace: str) -> str:
        return (f"workspace {workspace} cannot be forked: process {self.task.pid} ({self.task.command}) "
                f"{self.what}; {self.why}")


def check(workspace: str, pids: Sequence[int]) -> None:
    """Raise ``NotForkable`` for the first thing in the tree ``pids`` (its init first)
    that CRIU cannot carry; nothing is touched."""
    found = refusals(pids)
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise NotForkable(first.message(workspace) + more, hint=first.hint, process=first.task.pid,
                          command=first.task.command, object=first.what)


def refusals(pids: Sequence[int], proc: Path = Path("/proc")) -> list[Refusal]:
    """Everything in the tree ``pids`` (its init first) that CRIU cannot carry."""
    if not pids:
        return []
    root = pids[0]
    try:
        level = pid_level(root, proc)
    except OSError:
        return []  # the workspace's init is gone: the dump says so itself
    out: list[Refusal] = []
    own = _namespaces(root, proc)
    links: dict[int, dict[str, str]] = {}
    for pid in pids:
        out += _zombie_leader(pid, level, proc)
        out += _traced(pid, level, proc)
        if not _zombie(pid, proc):  # a zombie's namespaces are gone: nothing to nest
            out += _nested_namespaces(pid, level, own, proc)
        links[pid] = _fd_links(pid, proc)
        out += _files(pid, level, links[pid], proc)
    out += _deleted_watches(links, level, proc)
    return out


def _traced(pid: int, level: int, proc: Path) -> list[Refusal]:
    tracer = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                tracer = int(line.split()[1])
    if not tracer:
        return []
    by = Task.read(tracer, level, proc)
    return [Refusal(
        Task.read(pid, level, proc), f"is traced by process {by.pid} ({by.command})",
        "CRIU seizes every task with ptrace itself and cannot seize one another tracer holds "
        "(\"Unseizable non-zombie\")",
        hint="detach the tracer (end or detach strace or gdb) before forking")]


def _files(pid: int, level: int, links: dict[str, str], proc: Path) -> list[Refusal]:
    """Descriptors and mappings of kinds CRIU has no dumper for (secret memory named once)."""
    out: list[Refusal] = []
    secret: list[Refusal] = []
    for fd, link in sorted(links.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        kind = link.removeprefix("anon_inode:")
        if link.startswith("anon_inode:") and kind not in ANON_INODES:
            out.append(Refusal(
                Task.read(pid, level, proc), f"holds a {kind} descriptor (fd {fd})",
                f"CRIU has no dumper for {kind} descriptors (\"Can't dump file {fd} of that type\")",
                hint=f"close the {kind} descriptor before forking, or fork before the program opens it"))
        elif link.startswith(SECRETMEM) and not secret:
            secret = [_secretmem(Task.read(pid, level, proc), f"fd {fd}")]
    if not secret:
        with contextlib.suppress(OSError), open(proc / str(pid) / "maps", "rb") as f:
            if any(line.rstrip().endswith(SECRETMEM.encode() + b" (deleted)") for line in f):
                secret = [_secretmem(Task.read(pid, level, proc), "a mapping")]
    return out + secret


def _secretmem(task: Task, where: str) -> Refusal:
    return Refusal(
        task, f"holds secret memory (memfd_secret, {where})",
        "its pages are hidden from the kernel's other users, CRIU included (\"Unknown shit 100600 (/secretmem)\")",
        hint="free the secret memory before forking, or run the program without it (e.g. its option to keep "
             "keys in plain memory)")


def _zombie_leader(pid: int, level: int, proc: Path) -> list[Refusal]:
    try:
        stat = (proc / str(pid) / "stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        threads = len(os.listdir(proc / str(pid) / "task"))
    except (OSError, IndexError):
        return []
    if state != "Z" or threads < 2:
        return []
    return [Refusal(
        Task.read(pid, level, proc), f"is a zombie whose {threads - 1} other thread(s) still run",
        "its main thread exited (pthread_exit) and CRIU cannot dump a zombie thread-group leader",
        hint="fork before the main thread exits or after the process has ended; a program can keep its "
             "main thread waiting (pthread_join) instead of exiting it")]


def _zombie(pid: int, proc: Path) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (its namespaces but pid read ENOENT)."""
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _namespaces(pid: int, proc: Path) -> dict[str, str]:
    """The process's namespaces by kind. A namespace made for its children that no
    process has entered yet cannot be read (ENOENT): it shows as ``"unborn"``.

    A process that is exiting drops its namespace set (``exit_task_namespaces``) before it
    is a zombie: from then on ``uts`` and ``pid_for_children`` read ENOENT while ``pid``
    still reads. Such a process has nothing to nest, so none of its namespaces is reported
    (else ``pid_for_children`` would pass for an unborn one of its own). The set never comes
    back, so ``uts`` readable *after* an ENOENT means the ENOENT was an unborn namespace."""
    out: dict[str, str] = {}
    for ns in (*NESTED_NS, *FOR_CHILDREN):
        try:
            out[ns] = os.readlink(proc / str(pid) / "ns" / ns)
        except FileNotFoundError:
            if ns in FOR_CHILDREN and (proc / str(pid) / "ns").is_dir():
                out[ns] = "unborn"
        except OSError:
            pass
    if "unborn" in out.values() and not _has_namespace_set(pid, proc):
        return {}
    return out


def _has_namespace_set(pid: int, proc: Path) -> bool:
    """Whether ``pid`` still holds its namespaces (it is not past ``exit_task_namespaces``)."""
    try:
        os.readlink(proc / str(pid) / "ns" / "uts")
    except OSError:
        return False
    return True


def _nested_namespaces(pid: int, level: int, own: dict[str, str], proc: Path) -> list[Refusal]:
    mine = _namespaces(pid, proc)
    out: list[Refusal] = []
    for ns in NESTED_NS:
        if ns in mine and ns in own and mine[ns] != own[ns]:
            out.append(_nested(Task.read(pid, level, proc), ns, "is in its own"))
    for ns, of in FOR_CHILDREN.items():
        if ns in mine and of in own and mine[ns] != own[of] and mine.get(of) == own[of]:
            out.append(_nested(Task.read(pid, level, proc), of, "made for its children its own"))
    return out


def _nested(task: Task, ns: str, how: str) -> Refusal:
    return Refusal(
        task, f"{how} {ns} namespace",
        f"CRIU cannot dump a nested {ns} namespace",
        hint=f"run the program without its own {ns} namespace (for a sandbox: its no-sandbox option), "
             "or end it before forking")


def _fd_links(pid: int, proc: Path) -> dict[str, str]:
    """What each open descriptor of ``pid`` is (``/proc/PID/fd``), by fd number."""
    fds = proc / str(pid) / "fd"
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                out[fd] = os.readlink(fds / fd)
    return out


def _kdev(dev: int) -> int:
    """``st_dev`` as the kernel's own dev_t (``MKDEV``: 20 bits of minor), as fdinfo and maps print it."""
    return (os.major(dev) << 20) | os.minor(dev)


def _watches(pid: int, links: dict[str, str], proc: Path) -> list[tuple[str, int, int]]:
    """(fd, kernel dev, inode) of each inotify watch ``pid`` holds (``links``: its descriptors)."""
    out = []
    for fd, link in links.items():
        if link == "anon_inode:inotify":
            with contextlib.suppress(OSError):
                info = (proc / str(pid) / "fdinfo" / fd).read_text()
                out += [(fd, int(dev, 16), int(ino, 16)) for ino, dev in _WATCH.findall(info)]
    return out


def _held_deleted(pid: int, links: dict[str, str], proc: Path) -> set[tuple[int, int]]:
    """(kernel dev, inode) of the deleted files and folders ``pid`` holds: descriptors,
    working directory, root, mappings. A descriptor's are its mount's device and its
    inode (fdinfo: a stat through an overlay shows the layer's device, a watch the overlay's)."""
    base = proc / str(pid)
    out: set[tuple[int, int]] = set()
    fds = [fd for fd, link in links.items() if link.endswith(_DELETED)]
    if fds:
        with contextlib.suppress(OSError, ValueError):
            devs = {m.mount_id: (m.major << 20) | m.minor for m in mountinfo.read(str(base / "mountinfo"))}
            for fd in fds:
                with contextlib.suppress(OSError, ValueError, KeyError):
                    info = dict(ln.split(":", 1) for ln in (base / "fdinfo" / fd).read_text().splitlines() if ":" in ln)
                    out.add((devs[int(info["mnt_id"])], int(info["ino"])))
    for name in ("cwd", "root"):
        with contextlib.suppress(OSError):
            if os.readlink(base / name).endswith(_DELETED):
                st = os.stat(base / name)  # (a folder: through an overlay, the overlay's device)
                out.add((_kdev(st.st_dev), st.st_ino))
    with contextlib.suppress(OSError), open(base / "maps", "rb") as f:
        for line in f:
            if line.rstrip().endswith(_DELETED.encode()):
                fields = line.split()
                major, minor = (int(x, 16) for x in fields[3].split(b":"))
                out.add(((major << 20) | minor, int(fields[4])))
    return out


def _deleted_watches(links: dict[int, dict[str, str]], level: int, proc: Path) -> list[Refusal]:
    """Watches on files or folders deleted since (paid only by a tree holding a watch;
    ``links``: each process's descriptors)."""
    watches = {pid: w for pid, fds in links.items() if (w := _watches(pid, fds, proc))}
    if not watches:
        return []
    deleted: set[tuple[int, int]] = set()
    for pid, fds in links.items():
        deleted |= _held_deleted(pid, fds, proc)
    return [Refusal(
        Task.read(pid, level, proc), f"has an inotify watch (fd {fd}) on a deleted file or folder (inode {ino})",
        "CRIU records a watch by its path and a deleted one has none (\"fsnotify: Unable to open (null)\")",
        hint="remove the watch (inotify_rm_watch) or close what holds the deleted file or folder open, then fork")
        for pid, ws in watches.items() for fd, dev, ino in ws if (dev, ino) in deleted]
