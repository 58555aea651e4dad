"""A running process's pages copied into a memory file with ``process_vm_readv``.

``copy_runs_buffered`` (``memfile.live``'s pre-copy): each read, one call of up
to ``IOV_MAX`` runs and ``BUFFER`` bytes, goes into a private buffer of the host's
(ctypes lets the GIL go during the call: ``threads`` of them side by side), the
caller's ``check_alive`` is asked, and only then are its bytes written into the
file (``pwrite``: tmpfs does not zero a page a write fills, and a full filesystem
is an ``OSError``, never a ``SIGBUS``). The pid names the process at each call, so
a pid reused meanwhile could be read: its bytes never reach the file, so the copy
may run while the file is readable from inside. Each copying thread runs at
``NICE`` meanwhile (then back to its own value; without CAP_SYS_NICE as it is): the
copy is CPU-bound, and on a busy machine it otherwise gets a share like any loop's.

(Until 2026-12-02 the runs were read straight into a ``MAP_SHARED`` mapping of the
file, dense regions as huge pages, while the file was still host root's 0600: on
this VM huge pages come from memory given back to the host and cost a fault there
on first touch, ~4 s per GiB; see the README's *Piece by piece*.)
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ..kernel.syscalls import thread_nice

BUFFER = 4 << 20  # the bytes of one read (each thread's own buffer)
NICE = -5  # the copying threads' nice while they copy (the fork's critical path; as restore_boost's threads)
IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong)


def _batches(runs: Sequence[tuple[int, int]], limit: int) -> list[list[tuple[int, int]]]:
    """``runs`` cut into calls of at most ``IOV_MAX`` pieces and ``limit`` bytes each."""
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


def _read(pid: int, base: int, batch: list[tuple[int, int]]) -> int:
    """One ``process_vm_readv`` of ``batch``, its runs one after another from ``base``."""
    n = len(batch)
    local, remote = (_Iovec * n)(), (_Iovec * n)()
    want = 0
    for i, (lo, hi) in enumerate(batch):
        local[i].base, local[i].len = base + want, hi - lo
        remote[i].base, remote[i].len = lo, hi - lo
        want += hi - lo
    got = _libc.process_vm_readv(pid, local, n, remote, n, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"process_vm_readv of process {pid}: {os.strerror(err)}")
    if got != want:  # (a run unmapped meanwhile)
        raise OSError(0, f"process_vm_readv of process {pid} read {got} of {want} bytes: its memory changed")
    return int(got)


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
        got = _read(pid, base, batch)
        check_alive()
        view, at = memoryview(buf), 0
        try:
            for lo, hi in batch:
                _pwrite_all(dst, view[at:at + hi - lo], lo + shift)
                at += hi - lo
        finally:
            view.release()
        return got

    def boosted(batch: list[tuple[int, int]]) -> int:
        with thread_nice(NICE):
            return one(batch)

    if threads <= 1 or len(batches) == 1:
        return sum(boosted(b) for b in batches)
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(boosted, batches))


def _pwrite_all(fd: int, data: memoryview, off: int) -> None:
    while data:
        done = os.pwrite(fd, data, off)
        data, off = data[done:], off + done
