"""A workspace's procfs, read from the host without trusting its paths.

The host reaches a workspace's processes through ``/proc/PID/root/proc``: ``/proc/PID/root``
is the host's own magic link to the workspace's root, but ``proc`` below it and everything
under that are the workspace's to arrange if it could mount (seccomp denies it mounts; this
holds without that). A symlink there is resolved by the host: an absolute one against the
host's root. So :func:`open_proc` opens ``proc`` with ``O_NOFOLLOW`` and keeps it only if
``fstatfs`` says procfs (``PROC_SUPER_MAGIC``), and every name under it is opened with
``openat2(2)`` (Linux >= 5.6) under ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV``: no symlink followed, no ``..`` out, no mount
crossed (a file system mounted over a part of it is refused, not read). Reads take at most
``MAX_READ`` bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct

PROC_SUPER_MAGIC = 0x9FA0  # statfs(2) f_type of procfs
MAX_READ = 4096  # bytes of one file read: a task's stat, schedstat, wchan, status' ctxt lines fit
SYS_OPENAT2 = 437  # the same number on every architecture (asm-generic)
RESOLVE_NO_XDEV, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x01, 0x02, 0x04, 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_STATFS = struct.Struct("=l")  # struct statfs's first field, f_type (a long on x86-64 and arm64)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_FILE = _OpenHow(os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0, _RESOLVE)  # never waits (a FIFO)
_DIR = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, 0, _RESOLVE)
_FILE_AT, _DIR_AT, _HOW_SIZE = ctypes.addressof(_FILE), ctypes.addressof(_DIR), ctypes.sizeof(_OpenHow)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)  # its own: typed below
_syscall = _libc.syscall  # typed: ctypes converts the arguments itself (5 us an open, not 9)
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
_fstatfs = _libc.fstatfs
_fstatfs.restype = ctypes.c_int
_fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


class NotProcfs(OSError):
    """What stands at a workspace's ``proc`` is no procfs (a symlink, another file system)."""


def fs_type(fd: int) -> int:
    """``fstatfs(fd)``'s ``f_type``: the file system's magic number."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(_STATFS.unpack_from(buf.raw)[0])


def open_proc(root: str) -> int:
    """A descriptor (``O_CLOEXEC``) of the procfs at ``root``/proc (``root``: a path the host
    trusts, such as ``/proc/PID/root``). ``NotProcfs`` if ``proc`` is a symlink (never
    followed) or not procfs; ``OSError`` if it cannot be opened (the workspace is gone)."""
    try:
        fd = os.open(f"{root}/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotProcfs(e.errno, f"{root}/proc is a symlink or no folder: not followed") from None
        raise
    try:
        kind = fs_type(fd)
    except BaseException:
        os.close(fd)
        raise
    if kind != PROC_SUPER_MAGIC:
        os.close(fd)
        raise NotProcfs(errno.EXDEV, f"{root}/proc is no procfs (file system magic {kind:#x})")
    return fd


def open_at(folder: int, path: str, *, directory: bool = False) -> int:
    """``path`` under the descriptor ``folder`` (a procfs :func:`open_proc` gave, or a folder
    of it), opened read-only: ``OSError`` (``ELOOP``, ``EXDEV``...) rather than through a
    symlink, ``..`` or a mount."""
    fd: int = _syscall(SYS_OPENAT2, folder, path.encode(), _DIR_AT if directory else _FILE_AT, _HOW_SIZE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def read_at(folder: int, path: str, limit: int = MAX_READ) -> bytes:
    """At most ``limit`` bytes of ``path`` under ``folder`` (see :func:`open_at`), in one read:
    a procfs file gives a small one whole."""
    fd = open_at(folder, path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


__all__ = ["MAX_READ", "PROC_SUPER_MAGIC", "NotProcfs", "fs_type", "open_at", "open_proc", "read_at"]
