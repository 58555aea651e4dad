"""Container launcher: ``python -m bunshin.runtime.init`` with a JSON spec on stdin.

Runs on the host side of the workspace boundary, as a short-lived child of the
creating process. It joins the workspace's cgroups, unshares the namespaces and
forks the workspace's first process (pid 1 inside), which builds /proc and /dev
inside the already-mounted overlay root, pivots into it and execs
the in-workspace agent. The launcher prints pid 1's host pid and exits, so the
workspace is re-parented away from the caller and outlives it.

Failures before the exec are written to stderr; on success pid 1 points its
stderr at the agent log inside the workspace, which closes the caller's pipe.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys

from . import syscalls as sc

_DEVICES = {  # name: (major, minor)
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}


def _mkdir(path: str, mode: int = 0o755) -> None:
    """Create ``path`` with exactly ``mode`` (umask aside) unless it exists."""
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, mode)


def _build_dev(root: str) -> None:
    """/dev as a folder of the upper layer (nodes, links, shm) plus a private devpts."""
    dev = f"{root}/dev"
    _mkdir(dev)
    for name, (major, minor) in _DEVICES.items():
        if not os.path.lexists(f"{dev}/{name}"):
            os.mknod(f"{dev}/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(f"{dev}/{name}", 0o666)
    for name, target in {
        "fd": "/proc/self/fd",
        "stdin": "/proc/self/fd/0",
        "stdout": "/proc/self/fd/1",
        "stderr": "/proc/self/fd/2",
        "ptmx": "pts/ptmx",
    }.items():
        if not os.path.lexists(f"{dev}/{name}"):
            os.symlink(target, f"{dev}/{name}")
    _mkdir(f"{dev}/pts")
    sc.mount("devpts", f"{dev}/pts", "devpts", sc.MS_NOSUID | sc.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    _mkdir(f"{dev}/shm", 0o1777)


def _build_mounts(root: str) -> None:
    """/proc (with /proc/sys read-only) and devpts are the only mounts inside; /dev,
    /tmp and /run are folders of the upper layer (empty ones on the host image)."""
    sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
    _mkdir(f"{root}/proc")
    sc.mount("proc", f"{root}/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC)
    # /proc/sys is global for most keys: inside it is read-only.
    sc.mount(f"{root}/proc/sys", f"{root}/proc/sys", None, sc.MS_BIND)
    sc.mount(f"{root}/proc/sys", f"{root}/proc/sys", None, sc.MS_BIND | sc.MS_REMOUNT | sc.MS_RDONLY)
    _build_dev(root)
    _mkdir(f"{root}/tmp", 0o1777)
    _mkdir(f"{root}/run")
    os.chdir(root)
    sc.pivot_root(".", ".")
    sc.umount(".", sc.MNT_DETACH)
    os.chdir("/")


def _become_pid1(spec: dict) -> None:
    """Runs as pid 1 of the new namespaces; never returns."""
    _build_mounts(spec["root"])
    socket.sethostname(spec["hostname"])
    sc.loopback_up()
    os.setsid()
    os.makedirs(os.path.dirname(spec["log"]), exist_ok=True)
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)  # closes the caller's stderr pipe: the caller stops waiting on it
    os.closerange(3, 1 << 16)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def main() -> None:
    spec = json.loads(sys.stdin.read())
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    sc.unshare(sc.CLONE_NEWNS | sc.CLONE_NEWUTS | sc.CLONE_NEWIPC | sc.CLONE_NEWNET | sc.CLONE_NEWPID)
    pid = os.fork()
    if pid:
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        os._exit(0)
    try:
        _become_pid1(spec)
    except BaseException as e:  # report and die: the caller reads stderr
        sys.stderr.write(f"workspace init failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
