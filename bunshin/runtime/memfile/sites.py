"""Where a dumped process can issue system calls from: the addresses the trap's filter admits.

The filter traps a call only when it comes from one of these addresses, so a
program exec'd in a clone (which keeps the filter but has no handler) is trapped
only if one of its own ``syscall`` instructions lands on exactly one of these
addresses. For each executable file mapping every ``0f 05`` byte pair of the
mapped text is a site (a superset of the real ``syscall`` instructions: a false
one only admits an address no call comes from); the filter compares the
address after it (what the kernel reports). Anonymous executable memory (JIT
code) is admitted whole, as a span. A process whose executable is not
position-independent, or that runs without address randomisation, is refused:
a program exec'd from it would load at the same addresses.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .criu_images import (
    MAP_ANONYMOUS,
    PROT_EXEC,
    VMA_FILE_PRIVATE,
    VMA_FILE_SHARED,
    is_memfile_name,
)
from .fileio import open_in_root

_SYSCALL = re.compile(b"\x0f\x05", re.DOTALL)
_SCAN_LIMIT = 256 << 20  # executable bytes of one process scanned at most
MAX_SITES = 1500  # more cannot be compared within BPF's 4,096 instructions anyway
_READ = 16 << 20
_ET_EXEC, _PT_INTERP = 2, 3
ADDR_NO_RANDOMIZE = 0x0040000
VMA_AREA_VSYSCALL, VMA_AREA_VDSO, VMA_AREA_VVAR = 0x4, 0x8, 0x1000


class SitesUnavailable(Exception):
    """The process's system call sites cannot be told (the reason is the message)."""


@dataclass(frozen=True)
class Sites:
    addresses: tuple[int, ...]  # sorted: the address after each syscall instruction
    spans: tuple[tuple[int, int], ...]  # executable memory admitted whole


class _Cache:
    """Offsets of ``0f 05`` in a file range, by (device, inode, size, mtime, offset, length)."""

    def __init__(self, limit: int = 1024) -> None:
        self._seen: dict[tuple[int, ...], list[int]] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def offsets(self, fd: int, off: int, length: int) -> list[int]:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, off, length)
        with self._lock:
            if key in self._seen:
                return self._seen[key]
        found: list[int] = []
        pos = 0
        while pos < length and len(found) <= MAX_SITES:  # a hostile file of 0f 05 stops early
            data = os.pread(fd, min(_READ, length - pos) + 1, off + pos)  # one byte over: pairs across reads
            if not data:
                break
            found += [pos + m.start() for m in _SYSCALL.finditer(data) if pos + m.start() + 1 < length]
            pos += _READ
        found = sorted(set(found))[: MAX_SITES + 1]
        with self._lock:
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[key] = found
        return found


_CACHE = _Cache()


def syscall_sites(
    core: dict[str, Any],
    mm: dict[str, Any],
    vmas: list[dict[str, Any]],
    files: dict[int, dict[str, Any]],
    root: Path,
    skip: tuple[int, int],
) -> Sites:
    """The sites of one process (``skip``: the handler's own range)."""
    if int(core.get("tc", {}).get("personality", 0)) & ADDR_NO_RANDOMIZE:
        raise SitesUnavailable("it runs without address randomisation (programs it execs would share its addresses)")
    fixed_exe = _fixed_executable(mm, files, root)
    addresses: set[int] = set()
    spans: list[tuple[int, int]] = []
    scanned = 0
    for v in vmas:
        start, end = v["start"], v["end"]
        if not v["prot"] & PROT_EXEC or (start < skip[1] and end > skip[0]):
            continue
        if v["status"] & (VMA_AREA_VSYSCALL | VMA_AREA_VDSO | VMA_AREA_VVAR):
            continue  # the kernel's: vDSO fallbacks make none of the calls we trap
        if fixed_exe is not None and v["shmid"] == fixed_exe and not v["flags"] & MAP_ANONYMOUS:
            continue  # a non-PIE executable's own text, the same in a copy it execs
        name = _file_name(v, files)
        if name is None:
            spans.append((start, end))  # anonymous code (a JIT): admitted whole
            continue
        scanned += end - start
        if scanned > _SCAN_LIMIT:
            raise SitesUnavailable("it maps more executable code than is scanned for system calls")
        fd = open_in_root(root, name)
        if fd is None:
            raise SitesUnavailable(f"its code file {name} cannot be read")
        try:
            for off in _CACHE.offsets(fd, v["pgoff"], end - start):
                addresses.add(start + off + 2)
        finally:
            os.close(fd)
        if len(addresses) > MAX_SITES:
            raise SitesUnavailable(f"its code has more than {MAX_SITES} system call sites")
    return Sites(tuple(sorted(addresses)), tuple(spans))


def _file_name(v: dict[str, Any], files: dict[int, dict[str, Any]]) -> str | None:
    if v["flags"] & MAP_ANONYMOUS or not v["status"] & (VMA_FILE_PRIVATE | VMA_FILE_SHARED):
        return None
    name = str(files.get(v["shmid"], {}).get("reg", {}).get("name", ""))
    return None if not name or is_memfile_name(name) else name


def _fixed_executable(mm: dict[str, Any], files: dict[int, dict[str, Any]], root: Path) -> int | None:
    """The file id of the executable if it is not position-independent (and dynamically linked)."""
    exe_id = mm.get("exe_file_id", -1)
    exe = files.get(exe_id, {}).get("reg", {}).get("name")
    if not exe:
        return None
    fd = open_in_root(root, str(exe))
    if fd is None:
        raise SitesUnavailable(f"its executable {exe} cannot be read")
    try:
        head = os.pread(fd, 64, 0)
        if len(head) < 64 or head[:4] != b"\x7fELF" or struct.unpack_from("<H", head, 16)[0] != _ET_EXEC:
            return None
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        table = os.pread(fd, phentsize * min(phnum, 256), phoff)
    finally:
        os.close(fd)
    types = {struct.unpack_from("<I", table, i)[0] for i in range(0, len(table) - 3, max(phentsize, 4))}
    if _PT_INTERP not in types:
        raise SitesUnavailable(
            f"its executable {exe} is statically linked and not position-independent "
            "(a copy it execs would share its addresses)"
        )
    return int(exe_id)
