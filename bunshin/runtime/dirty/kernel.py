"""The kernel interfaces of dirty tracking: userfaultfd ioctls and ``PAGEMAP_SCAN`` (Linux >= 6.7)."""

from __future__ import annotations

import ctypes
import fcntl
import os
from dataclasses import dataclass

NR_USERFAULTFD, NR_CLOSE, NR_PIDFD_OPEN, NR_PIDFD_GETFD = 323, 3, 434, 438
UFFD_USER_MODE_ONLY = 1
O_NONBLOCK, O_CLOEXEC = 0o4000, 0o2000000
UFFD_API = 0xAA
UFFD_FEATURE_WP_UNPOPULATED, UFFD_FEATURE_WP_ASYNC = 1 << 13, 1 << 15
UFFDIO_REGISTER_MODE_WP = 1 << 1
UFFDIO_WRITEPROTECT_MODE_WP = 1 << 0
UFFDIO_API, UFFDIO_REGISTER, UFFDIO_UNREGISTER = 0xC018AA3F, 0xC020AA00, 0x8010AA01
UFFDIO_WRITEPROTECT = 0xC018AA06
PAGEMAP_SCAN = 0xC0606610
PM_SCAN_WP_MATCHING, PM_SCAN_CHECK_WPASYNC = 1 << 0, 1 << 1
PAGE_IS_WPALLOWED, PAGE_IS_WRITTEN, PAGE_IS_PRESENT, PAGE_IS_SWAPPED = 1 << 0, 1 << 1, 1 << 3, 1 << 4
PAGE_IS_PFNZERO = 1 << 5

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class UffdApi(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class UffdRange(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class UffdRegister(ctypes.Structure):
    _fields_ = [("range", UffdRange), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class UffdWriteProtect(ctypes.Structure):
    _fields_ = [("range", UffdRange), ("mode", ctypes.c_uint64)]


class PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class PmScanArg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


def _ioctl(fd: int, request: int, arg: ctypes.Structure) -> None:
    fcntl.ioctl(fd, request, arg)


def pidfd_getfd(pid: int, target_fd: int) -> int:
    """A copy, in the host, of the open file ``target_fd`` of process ``pid``."""
    pidfd = os.pidfd_open(pid)
    try:
        fd = _libc.syscall(NR_PIDFD_GETFD, pidfd, target_fd, 0)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd({pid}, {target_fd}): {os.strerror(err)}")
        return int(fd)
    finally:
        os.close(pidfd)


def api(uffd: int) -> None:
    """Enable asynchronous write-protect faults (no messages: the kernel resolves them)."""
    arg = UffdApi(UFFD_API, UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED, 0)
    _ioctl(uffd, UFFDIO_API, arg)


def register_wp(uffd: int, start: int, length: int) -> None:
    _ioctl(uffd, UFFDIO_REGISTER, UffdRegister(UffdRange(start, length), UFFDIO_REGISTER_MODE_WP, 0))


def unregister(uffd: int, start: int, length: int) -> None:
    _ioctl(uffd, UFFDIO_UNREGISTER, UffdRange(start, length))


def write_protect(uffd: int, start: int, length: int) -> None:
    _ioctl(uffd, UFFDIO_WRITEPROTECT, UffdWriteProtect(UffdRange(start, length), UFFDIO_WRITEPROTECT_MODE_WP))


@dataclass(frozen=True)
class Run:
    """Pages ``[start, end)`` written since they were last protected."""

    start: int
    end: int


def scan_written(pagemap_fd: int, start: int, end: int, *, protect: bool, batch: int = 4096) -> list[Run]:
    """The written runs in ``[start, end)``; with ``protect`` they are write-protected again, atomically."""
    return _scan(pagemap_fd, start, end, (PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC) if protect else 0,
                 PAGE_IS_WRITTEN, 0, batch)


def scan_populated(pagemap_fd: int, start: int, end: int, batch: int = 4096) -> list[Run]:
    """The runs in ``[start, end)`` that hold pages (in memory or swapped out); holes read as zeros.
    (Write-protect markers on pages never touched count as swapped: see ``scan_present``.)"""
    return _scan(pagemap_fd, start, end, 0, 0, PAGE_IS_PRESENT | PAGE_IS_SWAPPED, batch)


def scan_present(pagemap_fd: int, start: int, end: int, batch: int = 4096) -> list[Run]:
    """The runs in ``[start, end)`` in memory but the shared zero page (what a page only read maps)."""
    return _scan(pagemap_fd, start, end, 0, PAGE_IS_PFNZERO, PAGE_IS_PRESENT, batch, inverted=PAGE_IS_PFNZERO)


def scan_swapped(pagemap_fd: int, start: int, end: int, batch: int = 4096) -> list[Run]:
    """The runs in ``[start, end)`` swapped out, or holding a write-protect marker (never touched)."""
    return _scan(pagemap_fd, start, end, 0, 0, PAGE_IS_SWAPPED, batch)


def _scan(pagemap_fd: int, start: int, end: int, flags: int, mask: int, anyof: int, batch: int,
          inverted: int = 0) -> list[Run]:
    vec = (PageRegion * batch)()
    out: list[Run] = []
    pos = start
    while pos < end:
        arg = PmScanArg(size=ctypes.sizeof(PmScanArg), flags=flags, start=pos, end=end, vec=ctypes.addressof(vec),
                        vec_len=batch, category_inverted=inverted, category_mask=mask,
                        category_anyof_mask=anyof, return_mask=(mask & ~inverted) | anyof)
        n = fcntl.ioctl(pagemap_fd, PAGEMAP_SCAN, arg)
        out += [Run(vec[i].start, vec[i].end) for i in range(n)]
        if arg.walk_end <= pos:
            break
        pos = arg.walk_end
    return _merged(out)


def wp_covered(pagemap_fd: int, start: int, end: int) -> bool:
    """Whether ``[start, end)`` is mapped whole and registered for async write-protect."""
    vec = (PageRegion * 2)()
    arg = PmScanArg(size=ctypes.sizeof(PmScanArg), start=start, end=end, vec=ctypes.addressof(vec), vec_len=2,
                    category_mask=PAGE_IS_WPALLOWED, return_mask=PAGE_IS_WPALLOWED)
    n = fcntl.ioctl(pagemap_fd, PAGEMAP_SCAN, arg)
    return bool(n == 1 and vec[0].start == start and vec[0].end == end)


def _merged(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for r in runs:
        if out and out[-1].end == r.start:
            out[-1] = Run(out[-1].start, r.end)
        else:
            out.append(r)
    return out
