"""A running process's pages copied into a memory file with ``process_vm_readv``.

``copy_runs_buffered`` (what ``memfile.live`` uses): each read goes into a
private buffer of the host's, the pidfd is asked, and only then are its bytes
written into the file (``pwrite``: tmpfs does not zero a page a write fills, and a
full filesystem is an ``OSError``). The bytes of a pid reused meanwhile never reach
the file, so it may run while the file is readable from inside.

``copy_runs``: ``process_vm_readv`` moves each run from the process into a ``MAP_SHARED``
mapping of its slot in the file: one copy, in the kernel, no Python buffer,
up to ``IOV_MAX`` runs and ``BATCH`` bytes a call, the batches spread over
``threads`` (ctypes lets the GIL go during the call). Each run's file range is
allocated first (``fallocate``): a full filesystem is an ``OSError``, never a
``SIGBUS`` on a store into the mapping. Zero pages the process holds are
copied as data (the file keeps holes only where it held no page).

The pid names the process at each call, so the caller must hold a pidfd and
ask it after the copy (``check_alive``): a pid reused meanwhile may have been
read. ``huge`` (a ``huge=advise`` tmpfs): every 2 MiB region of the file that the
runs fill to at least ``fileio.DENSE`` is left unallocated and faulted in by the
copy through a ``MADV_HUGEPAGE`` mapping, as one huge page (its pages not in the
runs then read zero from it, as holes do; a full filesystem still fails the
copy: the kernel's fault in ``process_vm_readv`` ends it short, never a signal);
sparser regions are allocated page by page as without.

Use it only while the file is unreadable to the workspace (host root's,
mode 0600), so that a refusal that removes the file exposes nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .fileio import DENSE

BATCH = 64 << 20
BUFFER = 4 << 20  # a buffered copy's reads (each thread's own buffer)
IOV_MAX = 1024
HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def _batches(runs: Sequence[tuple[int, int]], limit: int = 0) -> list[list[tuple[int, int]]]:
    """``runs`` cut into calls of at most ``IOV_MAX`` pieces and ``limit`` (``BATCH``) bytes each."""
    limit = limit or BATCH
    out: list[list[tuple[int, int]]] = [[]]
    size = 0
    for lo, hi in runs:
        while lo < hi:
            if len(out[-1]) == IOV_MAX or size == limit:
                out.append([])
                size = 0
            n = min(hi - lo, limit - size)
            out[-1].append((lo, lo + n))
            size += n
            lo += n
    return [b for b in out if b]


def _read(pid: int, base: int, start: int, batch: list[tuple[int, int]], *, packed: bool = False) -> int:
    """One ``process_vm_readv`` of ``batch``: each run at ``base`` + its address - ``start``, or
    (``packed``) one after another from ``base``."""
    n = len(batch)
    local, remote = (_Iovec * n)(), (_Iovec * n)()
    want = 0
    for i, (lo, hi) in enumerate(batch):
        local[i].base, local[i].len = (base + want) if packed else (base + lo - start), hi - lo
        remote[i].base, remote[i].len = lo, hi - lo
        want += hi - lo
    got = _libc.process_vm_readv(pid, local, n, remote, n, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv of process {pid}: {os.strerror(err)}")
    if got != want:  # (a run unmapped meanwhile)
        raise OSError(0, f"process_vm_readv of process {pid} read {got} of {want} bytes: its memory changed")
    return int(got)


def dense_regions(runs: Sequence[tuple[int, int]], shift: int) -> set[int]:
    """The 2 MiB regions (file offset // ``HUGE``; a run's file offset is its address + ``shift``)
    that ``runs`` fill to at least ``DENSE``, whole regions only."""
    held: dict[int, int] = {}
    for lo, hi in runs:
        a = lo + shift
        while a < hi + shift:
            r = a // HUGE
            b = min(hi + shift, (r + 1) * HUGE)
            held[r] = held.get(r, 0) + b - a
            a = b
    return {r for r, n in held.items() if n >= DENSE * HUGE}


def _allocate(dst: int, lo: int, hi: int) -> None:
    if hi > lo and _libc.fallocate(dst, 0, lo, hi - lo) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"no room in the memory file: {os.strerror(err)}")


def copy_runs(pid: int, dst: int, start: int, end: int, offset: int, runs: Sequence[tuple[int, int]], *,
              check_alive: Callable[[], None], threads: int = 2, huge: bool = False) -> int:
    """Copy ``runs`` (page-aligned, inside ``[start, end)`` of ``pid``) into ``dst``, where ``start``
    lies at ``offset``; returns the bytes copied. ``check_alive`` raises if the process is not
    the one meant any more (it is called after every copy). ``huge``: dense regions as huge pages."""
    if not runs:
        return 0
    shift = offset - start
    dense = dense_regions(runs, shift) if huge else set()
    for lo, hi in runs:
        a, b = lo + shift, hi + shift
        while a < b:  # each region's part: allocated now unless it is to be one huge page
            r = a // HUGE
            c = min(b, (r + 1) * HUGE)
            if r not in dense:
                _allocate(dst, a, c)
            a = c
    mm = mmap.mmap(dst, end - start, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    if dense:
        mm.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        base = ctypes.addressof(anchor)
        batches = _batches(runs)
        if threads <= 1 or len(batches) == 1:
            total = sum(_read(pid, base, start, b) for b in batches)
        else:
            with ThreadPoolExecutor(threads) as pool:
                total = sum(pool.map(lambda b: _read(pid, base, start, b), batches))
    finally:
        del anchor
        mm.close()
    check_alive()
    return total


def copy_runs_buffered(pid: int, dst: int, shift: int, runs: Sequence[tuple[int, int]], *,
                       check_alive: Callable[[], None], threads: int = 2) -> int:
    """Copy ``runs`` (page-aligned addresses of ``pid``) into ``dst`` at address + ``shift``; returns
    the bytes copied. Each read (at most ``BUFFER`` bytes and ``IOV_MAX`` runs) is followed by
    ``check_alive`` (it raises if the process is not the one meant any more) before its bytes are
    written, so they are the process's own wherever the file can be read from."""
    batches = _batches(runs, BUFFER)
    if not batches:
        return 0
    local = threading.local()

    def one(batch: list[tuple[int, int]]) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = ctypes.create_string_buffer(BUFFER)
        base = ctypes.addressof(buf)
        got = _read(pid, base, 0, batch, packed=True)
        check_alive()
        view, at = memoryview(buf), 0
        try:
            for lo, hi in batch:
                _pwrite_all(dst, view[at:at + hi - lo], lo + shift)
                at += hi - lo
        finally:
            view.release()
        return got

    if threads <= 1 or len(batches) == 1:
        return sum(one(b) for b in batches)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, batches))


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    while data:
        done = os.pwrite(fd, data, off)
        data, off = data[done:], off + done
