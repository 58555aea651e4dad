"""Thin ctypes bindings for the few syscalls Python 3.11 lacks (unshare, mount, pivot_root)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19

MNT_DETACH = 2
SYS_PIVOT_ROOT = 155  # x86_64


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int = 0) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def setns_path(path: str, nstype: int) -> None:
    """Join the namespace of kind ``nstype`` that ``path`` (``/proc/PID/ns/...``) names."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd, nstype)
    finally:
        os.close(fd)


@contextlib.contextmanager
def thread_nice(nice: int) -> Iterator[None]:
    """This thread at ``nice`` (or its own, if lower) inside the block, then back to its own
    value, also on failure; without CAP_SYS_NICE it runs as it is."""
    tid = threading.get_native_id()
    try:
        own = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(own, nice))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, own)


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free [offset, offset + length) of a file, which then reads as zeros; its size stays."""
    _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _check(_libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length), "fallocate")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {fstype or 'bind'} {source} on {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def loopback_up() -> None:
    """Bring ``lo`` up in the caller's network namespace (adds 127.0.0.1 and ::1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


_SIOCSIFMTU = 0x8922


def set_mtu(name: str, mtu: int) -> None:
    """Set the MTU of link ``name`` in the caller's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), _SIOCSIFMTU, struct.pack("16si12x", name.encode(), mtu))


CLONE_NEWUSER = 0x10000000
_SYS_KEYCTL = 250
_KEYCTL_JOIN_SESSION_KEYRING = 1
PR_CAPBSET_DROP = 24
PR_SET_DUMPABLE = 4
_PR_GET_SECUREBITS, _PR_SET_SECUREBITS = 27, 28
_SECBIT_NO_SETUID_FIXUP = 1 << 2
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2
_SYS_CAPGET, _SYS_CAPSET = 125, 126
_CAP_V3 = 0x20080522


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    ret = _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(a2), ctypes.c_ulong(a3),
                      ctypes.c_ulong(a4), ctypes.c_ulong(a5))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return int(ret)


def become_keeping_caps(uid: int) -> None:
    """Become host uid and gid ``uid`` (real, effective, saved; no supplementary groups)
    and keep every capability, also across the next exec (as ambient capabilities): a
    user namespace made after is owned by ``uid`` (what CRIU's restore of a clone makes).
    Plain syscalls only (runs between fork and exec)."""
    prctl(_PR_SET_SECUREBITS, prctl(_PR_GET_SECUREBITS) | _SECBIT_NO_SETUID_FIXUP)
    head = (ctypes.c_uint32 * 2)(_CAP_V3, 0)
    data = (ctypes.c_uint32 * 6)()  # two of {effective, permitted, inheritable}
    syscall(_SYS_CAPGET, head, data)
    data[2], data[5] = data[1], data[4]  # inheritable = permitted (an ambient one must be both)
    syscall(_SYS_CAPSET, head, data)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # (no fixup: the capabilities stay)
    for cap in range(64):
        if not (data[1 + 3 * (cap // 32)] >> (cap % 32)) & 1:
            continue
        prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, cap)
    prctl(PR_SET_DUMPABLE, 1)


def syscall(nr: int, *args: object) -> int:
    """``syscall(2)`` by number (ctypes arguments); its result, or ``OSError`` from errno."""
    ret = int(_libc.syscall(ctypes.c_long(nr), *args))
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def join_session_keyring(name: str | None = None) -> None:
    """Give the caller a new anonymous (or named) session keyring: no key of the
    caller's old session keyring stays reachable from it or its children."""
    arg = ctypes.c_char_p(name.encode()) if name else None
    if _libc.syscall(ctypes.c_long(_SYS_KEYCTL), ctypes.c_int(_KEYCTL_JOIN_SESSION_KEYRING), arg) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)}")


#: Buckets of the TCP connection table of a network namespace ``new_netns`` makes. One
#: made from the host's shares the host's table (262,144 buckets here), which every
#: socket-diag dump of TCP sockets walks whole: CRIU's, once per family in every dump,
#: 1.45 ms each against 0.28 ms with a table of its own (8 KiB at this size).
NETNS_TCP_BUCKETS = 1024
_TCP_CHILD_BUCKETS = "/proc/sys/net/ipv4/tcp_child_ehash_entries"  # Linux >= 5.19


def _write_proc(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def size_netns_tables() -> None:
    """Make the network namespaces created from the caller's get a TCP table of
    ``NETNS_TCP_BUCKETS`` (OSError on a kernel without the setting)."""
    _write_proc(_TCP_CHILD_BUCKETS, str(NETNS_TCP_BUCKETS))


def new_netns(*, sized: bool = False) -> None:
    """Unshare a network namespace with ``lo`` up and a TCP table of its own, in which
    root of a user namespace the host made may still bind ports below 1024 and ping (it
    has no capability there: the namespace belongs to the host).

    A namespace's table is sized by the one it is made from, so a first namespace (dropped
    at once) only sets that size, unless the caller is in one ``size_netns_tables`` set
    (``sized``); the namespace kept sets it too, for the one CRIU makes inside it (a clone
    with TCP connections)."""
    unshare(CLONE_NEWNET)
    try:
        size_netns_tables()
    except OSError:
        pass  # an older kernel: the host's table, as before
    else:
        if not sized:
            unshare(CLONE_NEWNET)
            size_netns_tables()
    loopback_up()
    for key, value in (("ip_unprivileged_port_start", "0"), ("ping_group_range", "0 2147483647")):
        _write_proc(f"/proc/sys/net/ipv4/{key}", value)


def mount_sysfs(target: str) -> None:
    """A read-only sysfs at the folder ``target`` (a host path, or ``/proc/self/fd/N``)
    showing the caller's network namespace (made by the host: in a workspace's user
    namespace ``mount sysfs`` is refused for a network namespace the host owns)."""
    mount("sysfs", target, "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


def hold_netns(target: str) -> None:
    """Bind the caller's network namespace at ``target`` (a file made here): a sysfs
    shows its namespace's devices only while the namespace lives, and a restore's criu
    leaves the one it ran in (the clone's own is made by CRIU, inside its user namespace)."""
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    mount("/proc/self/ns/net", target, None, MS_BIND)


def open_dir_beneath(top: str | os.PathLike[str], parts: Iterable[str], *, path_only: bool = False,
                     make: bool = False, owner: int | None = None) -> int:
    """A descriptor of the folder ``top/parts...``, each component opened with
    ``O_NOFOLLOW`` from the one before: a symlink (or a file) on the way raises
    (``ENOTDIR``/``ELOOP``). ``path_only``: ``O_PATH`` descriptors. ``make``: a missing
    folder is made (0755), and given to uid and gid ``owner`` if one is named."""
    flags = (os.O_PATH if path_only else os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(top, flags)
    try:
        for part in parts:
            try:
                child = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                if owner is not None:
                    os.chown(part, owner, owner, dir_fd=fd, follow_symlinks=False)
                child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


_SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 429, 430, 431, 432  # x86_64
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_AT_FDCWD, _MOVE_MOUNT_F_EMPTY_PATH = -100, 0x4
#: overlayfs's most lower layers (OVL_MAX_STACK).
OVERLAY_MAX_LOWERS = 500


MOUNT_ATTR_RDONLY, MOUNT_ATTR_NODEV = 0x1, 0x4
_SYS_OPEN_TREE = 428  # x86_64
_OPEN_TREE_CLONE, _AT_RECURSIVE, _AT_SYMLINK_NOFOLLOW = 0x1, 0x8000, 0x100


def clone_tree(path: str, *, recursive: bool = False) -> int:
    """A detached copy of the mount at ``path`` (with the mounts beneath it when
    ``recursive``), as a close-on-exec descriptor another mount namespace can attach
    (``attach_tree``); a last component that is a symlink is not followed."""
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_SYMLINK_NOFOLLOW | (_AT_RECURSIVE if recursive else 0)
    return syscall(_SYS_OPEN_TREE, ctypes.c_int(_AT_FDCWD), path.encode(), ctypes.c_uint(flags))


def attach_tree(fd: int, target: str) -> None:
    """Mount the detached tree ``fd`` (``clone_tree``) on the folder ``target`` of the
    caller's mount namespace (a symlink at ``target`` is not followed)."""
    syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(_AT_FDCWD), target.encode(),
            ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))


def mount_overlay_fs(target: str, lowers: Sequence[str], upper: str | None = None, work: str | None = None,
                     attrs: int = 0, options: Sequence[tuple[str, str]] = ()) -> None:
    """An overlay at ``target`` through the new mount API: each lower given on its own
    (``lowerdir+``, Linux >= 6.8), so a deep stack is not bound by ``mount(2)``'s one
    page of options (~30 layers of store paths); still at most ``OVERLAY_MAX_LOWERS``.
    Without ``upper`` it is read-only (two lowers at least). ``attrs``: ``MOUNT_ATTR_*``;
    ``options``: more overlay options, as (key, value)."""
    fs = syscall(_SYS_FSOPEN, b"overlay", ctypes.c_uint(1))
    try:
        rw = [("upperdir", upper), ("workdir", work)] if upper is not None and work is not None else []
        for key, value in [*(("lowerdir+", p) for p in lowers), *rw, *options]:
            syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(_FSCONFIG_SET_STRING), key.encode(),
                    value.encode(), ctypes.c_int(0))
        syscall(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(_FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0))
        mnt = syscall(_SYS_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(1), ctypes.c_uint(attrs))
        try:
            syscall(_SYS_MOVE_MOUNT, ctypes.c_int(mnt), b"", ctypes.c_int(_AT_FDCWD), target.encode(),
                    ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
        finally:
            os.close(mnt)
    finally:
        os.close(fs)
