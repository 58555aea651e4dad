"""Container launcher: ``python -m bunshin.runtime.container.init`` with a JSON spec on stdin.

Runs on the host side of the workspace boundary, as a short-lived child of the
creating process. It joins the workspace's cgroups and forks a child that
unshares a user namespace; the launcher maps the child's ids 0..n-1 to the
unprivileged host range ``spec["ids"]`` (so uid 0 inside holds no capability in
the host's namespace), and the child unshares the other namespaces (owned by that user
namespace, the network namespace too, lo up: CRIU repairs TCP connections in a clone's
with that namespace's capabilities, which no workspace process keeps) and forks the
workspace's first process, pid 1 inside. The launcher joins the network namespace and
mounts its read-only sysfs at /sys (in a mount namespace of its own: nothing appears on
the host); pid 1 mounts /proc (with runc's masked
and read-only paths), masks parts of /sys and mounts a private devpts inside the already-mounted overlay root, pivots into it, drops the
capabilities no workspace process keeps, joins a keyring of its own, sets
no_new_privs with the seccomp filter (``seccomp``) and execs the in-workspace
agent. The launcher prints pid 1's host pid and exits, so the workspace is
re-parented away from the caller and outlives it.

Failures before the exec are written to stderr; on success pid 1 points its
stderr at the agent log inside the workspace, which closes the caller's pipe.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

from bunshin.agent.children import DROPPED_CAPS, PID1_ONLY_CAP

from ..kernel import syscalls as sc
from . import seccomp

# as ``netns_image`` sets it in a clone's (not imported: it loads the memfile package)
UNPRIVILEGED_PORT_START = "0"

# As runc: /proc files that show the host (bound to /dev/null), folders emptied
# (an empty read-only folder of the agent layer bound over them), folders read-only.
PROC_MASKED_FILES = ("kcore", "keys", "key-users", "timer_list", "sched_debug", "latency_stats",
                     "sysrq-trigger")
PROC_MASKED_DIRS = ("acpi", "scsi")
PROC_READ_ONLY = ("sys", "bus", "fs", "irq")
SYS_MASKED_DIRS = ("firmware", "devices/virtual/powercap", "kernel/security")
EMPTY_DIR = "/.bunshin/empty"  # in the agent layer: read-only and empty
_PROC_FLAGS = sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC


def _bind_read_only(src: str, dst: str, flags: int = 0) -> None:
    sc.mount(src, dst, None, sc.MS_BIND)
    sc.mount(src, dst, None, sc.MS_BIND | sc.MS_REMOUNT | sc.MS_RDONLY | flags)


def _mask_proc(root: str) -> None:
    proc = f"{root}/proc"
    for name in PROC_READ_ONLY:
        if os.path.isdir(f"{proc}/{name}"):
            _bind_read_only(f"{proc}/{name}", f"{proc}/{name}", _PROC_FLAGS)
    for name in PROC_MASKED_FILES:
        if os.path.exists(f"{proc}/{name}"):
            _bind_read_only(f"{root}/dev/null", f"{proc}/{name}", sc.MS_NOSUID | sc.MS_NOEXEC)
    for name in PROC_MASKED_DIRS:
        if os.path.isdir(f"{proc}/{name}"):
            _bind_read_only(f"{root}{EMPTY_DIR}", f"{proc}/{name}", _PROC_FLAGS)


def _mask_sys(root: str) -> None:
    """/sys is the read-only sysfs the launcher mounted (``_mount_sysfs``)."""
    for name in SYS_MASKED_DIRS:
        if os.path.isdir(f"{root}/sys/{name}"):
            _bind_read_only(f"{root}{EMPTY_DIR}", f"{root}/sys/{name}", _PROC_FLAGS)


def _build_mounts(root: str) -> None:
    """/proc (masked as runc does), /sys and devpts are the only mounts inside; /dev (its nodes made by the host), /tmp and /run are folders of the upper."""
    sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
    # The overlay was mounted by the host: in this user namespace's copy of the mount
    # tree it is locked, and pivot_root refuses a locked new root. A bind of it is not.
    sc.mount(root, root, None, sc.MS_BIND | sc.MS_REC)
    # Mount points reached without following anything: the image's /proc could be a
    # symlink into the host's tree, still visible here before the pivot.
    _mount_at(root, "/proc", "proc", _PROC_FLAGS)
    _mask_proc(root)
    _mask_sys(root)
    _mount_at(root, "/dev/pts", "devpts", sc.MS_NOSUID | sc.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
    os.chdir(root)
    sc.pivot_root(".", ".")
    sc.umount(".", sc.MNT_DETACH)
    os.chdir("/")


def _lock_down() -> None:
    """What pid 1 (and so every process of the workspace) keeps: none of the
    capabilities its children drop but the one that confers nothing
    (``PID1_ONLY_CAP``), a keyring of its own, no_new_privs and the seccomp filter."""
    for name, cap in DROPPED_CAPS.items():
        if name == PID1_ONLY_CAP:
            continue
        try:
            sc.prctl(sc.PR_CAPBSET_DROP, cap)
        except OSError:
            pass  # a capability this kernel does not know
    sc.join_session_keyring()
    seccomp.install()


def _become_pid1(spec: dict[str, Any]) -> None:
    """Runs as pid 1 of the new namespaces; never returns."""
    _build_mounts(spec["root"])
    socket.sethostname(spec["hostname"])
    os.setsid()
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.closerange(3, 1 << 16)
    _lock_down()
    os.dup2(1, 2)  # closes the caller's stderr pipe: the caller stops waiting on it
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def _in_user_namespace(spec: dict[str, Any], unshared: int, mapped: int) -> None:
    """The child: a new user namespace, mapped by the launcher; then the rest.

    It becomes root inside's host uid first, so the namespace's owner is the workspace's
    own uid, not host root: what the kernel counts per owner at the initial namespace
    (inotify instances, message queues, pending signals, processes: ``idranges``) is then
    the workspace's alone."""
    owner = spec["ids"][0]
    os.setgroups([])
    os.setresgid(owner, owner, owner)
    os.setresuid(owner, owner, owner)  # every capability in the host's namespace goes
    sc.prctl(sc.PR_SET_DUMPABLE, 1)  # (a change of uid cleared it: /proc/self stays its own)
    sc.unshare(sc.CLONE_NEWUSER)
    os.write(unshared, b"u")
    if os.read(mapped, 1) != b"m":
        raise RuntimeError("the launcher did not map the user namespace")
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    # The network namespace is this user namespace's (so CRIU's restorer, which holds
    # its capabilities, can repair TCP connections in a clone's); nothing inside keeps
    # CAP_NET_ADMIN or CAP_NET_RAW over it (``_lock_down``). The launcher mounts its sysfs.
    sc.unshare(sc.CLONE_NEWNET)
    sc.loopback_up()
    os.write(unshared, b"n")
    if os.read(mapped, 1) != b"s":
        raise RuntimeError("the launcher did not mount the workspace's sysfs")
    sc.unshare(sc.CLONE_NEWNS | sc.CLONE_NEWUTS | sc.CLONE_NEWIPC | sc.CLONE_NEWPID)
    pid = os.fork()
    if pid:
        sys.stdout.write(f"{pid}\n")
        sys.stdout.flush()
        os._exit(0)
    _become_pid1(spec)


def _mount_point(root: str, path: str, owner: int | None) -> int:
    """An O_PATH fd of the folder ``root``/``path``, made (owned by root inside) where
    missing; nothing on the way is followed (the image's symlinks name host paths here)."""
    try:
        return sc.open_dir_beneath(root, path.strip("/").split("/"), path_only=True, make=True, owner=owner)
    except OSError as e:
        raise RuntimeError(f"mount point {path}: not a folder in the image ({e.strerror})") from e


def _mount_at(root: str, path: str, fstype: str, flags: int = 0, data: str | None = None,
              owner: int | None = None) -> None:
    """Mount a fresh ``fstype`` at ``root``/``path``, a folder reached (made where
    missing) without following any symlink."""
    fd = _mount_point(root, path, owner)
    try:
        sc.mount(fstype, f"/proc/self/fd/{fd}", fstype, flags, data)
    finally:
        os.close(fd)


def _mount_sysfs(root: str, owner: int) -> None:
    """/sys, read-only, on the image's folder reached without following anything (an
    image may bring a symlink there: this runs as host root)."""
    _mount_at(root, "/sys", "sysfs", sc.MS_RDONLY | _PROC_FLAGS, owner=owner)


def _bind_shared(root: str, mounts: list[dict[str, Any]], owner: int) -> None:
    """Host folders shared on purpose: the host's views of them (``idmap.share``) bound
    at their paths, in this mount namespace only (the workspace's is copied from it)."""
    for m in mounts:
        fd = _mount_point(root, m["path"], owner)
        try:
            sc.mount(m["source"], f"/proc/self/fd/{fd}", None, sc.MS_BIND)
        finally:
            os.close(fd)


def _enter_netns(pid: int, ids: list[int]) -> None:
    """Join the child's network namespace (a sysfs shows the mounter's) and set what
    the workspace has in it: any port to bind, ICMP echo sockets for all its groups
    (the host's ids: the sysctls are written from the host's user namespace)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        sc.setns(fd, sc.CLONE_NEWNET)
    finally:
        os.close(fd)
    base, count = ids
    for key, value in (("ip_unprivileged_port_start", UNPRIVILEGED_PORT_START), ("ping_group_range", f"{base} {base + count - 1}")):
        with open(f"/proc/sys/net/ipv4/{key}", "w") as f:
            f.write(value)


def _map_ids(pid: int, base: int, count: int) -> None:
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(f"0 {base} {count}\n")


def main() -> None:
    spec = json.loads(sys.stdin.read())
    for procs in spec["cgroup_procs"]:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    # The launcher's mount namespace, from which the workspace's is copied: /sys (the
    # sysfs of the workspace's network namespace, ``_enter_netns``) and shared folders.
    sc.unshare(sc.CLONE_NEWNS)
    sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
    _bind_shared(spec["root"], spec.get("mounts", []), spec["ids"][0])
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(unshared_r)
            os.close(mapped_w)
            _in_user_namespace(spec, unshared_w, mapped_r)
        except BaseException as e:  # report and die: the caller reads stderr
            sys.stderr.write(f"workspace init failed: {type(e).__name__}: {e}\n")
            sys.stderr.flush()
            os._exit(1)
    os.close(unshared_w)
    os.close(mapped_r)
    try:
        if os.read(unshared_r, 1) == b"u":
            _map_ids(pid, *spec["ids"])
            os.write(mapped_w, b"m")
            if os.read(unshared_r, 1) == b"n":
                _enter_netns(pid, spec["ids"])
                _mount_sysfs(spec["root"], spec["ids"][0])
                os.write(mapped_w, b"s")
    finally:
        os.close(mapped_w)
        _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
