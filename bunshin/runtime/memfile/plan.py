"""Planning a rewrite: what becomes of each area of one dumped process.

Each VMA gets a ``Kind``. Areas that get a slot in the new memory file
(``NEW_SLOT``) may first be cut: anonymous areas at glibc mmapped-chunk
boundaries (so ``mremap`` growth of one chunk reads its own slot's hole, as it
would read zeros, never the next chunk), private file mappings into the runs
worth converting (``filemaps.file_ranges``). The page map is then cut again at
the new boundaries.
"""

from __future__ import annotations

import bisect
import enum
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .criu_images import (
    MADV_WIPEONFORK,
    MAP_ANONYMOUS,
    MAP_NORESERVE,
    MAP_PRIVATE,
    PAGE,
    VMA_ANON_PRIVATE,
    VMA_AREA_HEAP,
    VMA_AREA_REGULAR,
    VMA_FILE_PRIVATE,
    Piece,
    is_memfile_name,
    load,
    split,
    stored_bytes,
)
from .filemaps import FileSources, convertible_file_map, file_ranges, in_file_end
from .rebasing import choose_rebase

_CONVERTIBLE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE


class Kind(enum.Enum):
    KEEP = 0
    CONVERT = 1  # private anonymous -> new memory file
    SHARED = 2  # already a memory-file mapping: keep, its pages are a delta
    REBASE = 3  # memory-file mapping -> new memory file (base data + delta)
    FILE = 4  # written private file mapping -> new memory file (file bytes + dumped pages)
    TRAP = 5  # the SIGSYS handler's code, table or state -> new memory file (``trap``)


NEW_SLOT = (Kind.CONVERT, Kind.REBASE, Kind.FILE, Kind.TRAP)


@dataclass
class Proc:
    """One process's images and the plan for each of its areas."""

    pid: int
    mm_img: dict[str, Any]
    pm_img: dict[str, Any]
    pages_path: Path
    kinds: list[Kind]
    pieces: list[Piece]
    base_paths: dict[int, Path] = field(default_factory=dict)  # shmid -> host memory file
    sources: dict[int, tuple[int, int]] = field(default_factory=dict)  # shmid -> (fd, size)
    trap: dict[int, bytes] = field(default_factory=dict)  # vma index -> bytes of a TRAP area

    @property
    def vmas(self) -> list[dict[str, Any]]:
        vmas: list[dict[str, Any]] = self.mm_img["entries"][0]["vmas"]
        return vmas

    def count(self, *kinds: Kind) -> int:
        return sum(k in kinds for k in self.kinds)


def convertible(vma: dict[str, Any], convert_heap: bool) -> bool:
    """A plain private anonymous area (whitelists: anything unusual stays as it is)."""
    flags, status = vma["flags"], vma["status"]
    if flags & ~_CONVERTIBLE_FLAGS or not flags & MAP_ANONYMOUS or not flags & MAP_PRIVATE:
        return False
    allowed = VMA_AREA_REGULAR | VMA_ANON_PRIVATE | (VMA_AREA_HEAP if convert_heap else 0)
    if status & ~allowed or not status & VMA_ANON_PRIVATE:
        return False
    return not vma.get("madv", 0) & (1 << MADV_WIPEONFORK)


def host_path(name: str, memfile_dir: Path, view: str) -> Path | None:
    """Where a memory file the tasks see as ``name`` lies on the host, if it is one of ours."""
    prefix = view.rstrip("/") + "/"
    if is_memfile_name(name) and name.startswith(prefix):
        return memfile_dir / name[len(prefix) :]
    return None


def plan(
    images_dir: Path,
    pid: int,
    files: dict[int, dict[str, Any]],
    *,
    convert_heap: bool,
    rebase_ratio: float | None,
    memfile_dir: Path,
    view: str,
    split_chunks: bool,
    convert_anon: bool,
    sources: FileSources | None,
) -> Proc | None:
    """Classify one process's areas; None if it has no memory of its own.

    ``convert_anon``: convert anonymous areas (False for a process whose allocator
    relies on zero-fill). ``sources``: where to read private mappings' files
    (None: leave file mappings alone).
    """
    mm_path = images_dir / f"mm-{pid}.img"
    pm_path = images_dir / f"pagemap-{pid}.img"
    if not mm_path.exists() or not pm_path.exists():
        return None  # a zombie, or memory shared with another task
    mm_img, pm_img = load(mm_path), load(pm_path)
    vmas = mm_img["entries"][0].get("vmas", [])
    head = pm_img["entries"][0]
    proc = Proc(
        pid,
        mm_img,
        pm_img,
        images_dir / f"pages-{head['pages_id']}.img",
        [Kind.KEEP] * len(vmas),
        split(pm_img["entries"][1:], vmas),
    )
    stored, missing = stored_bytes(proc.pieces)
    for i, v in enumerate(vmas):
        if v["status"] & VMA_FILE_PRIVATE and not v["flags"] & MAP_ANONYMOUS:
            shmid = v["shmid"]
            name = str(files.get(shmid, {}).get("reg", {}).get("name", ""))
            if is_memfile_name(name):
                proc.kinds[i] = Kind.SHARED
                base = host_path(name, memfile_dir, view)
                if base is not None:
                    proc.base_paths[shmid] = base
            elif (
                sources is not None and i in stored and i not in missing and convertible_file_map(v)
            ):
                src = sources.source(pid, shmid)
                if src is not None:
                    proc.kinds[i] = Kind.FILE
                    proc.sources[shmid] = src
        elif convert_anon and i in stored and i not in missing and convertible(v, convert_heap):
            proc.kinds[i] = Kind.CONVERT
    if proc.sources:
        _cut_file_maps(proc)
    if convert_anon and split_chunks:
        _cut_mmapped_chunks(proc)
    if rebase_ratio is not None:
        stored, missing = stored_bytes(proc.pieces)
        by_file: dict[int, list[int]] = {}
        for i, kind in enumerate(proc.kinds):
            shmid = proc.vmas[i]["shmid"]
            if kind is Kind.SHARED and shmid in proc.base_paths and i not in missing:
                by_file.setdefault(shmid, []).append(i)
        for i in choose_rebase(proc.vmas, by_file, proc.base_paths, stored, rebase_ratio):
            proc.kinds[i] = Kind.REBASE
    return proc


def _reshape(
    proc: Proc, cut: Callable[[int, dict[str, Any], Kind], list[tuple[int, int, Kind]]]
) -> bool:
    """Replace each area by the parts ``cut`` gives (covering it); True if anything changed."""
    new_vmas: list[dict[str, Any]] = []
    new_kinds: list[Kind] = []
    changed = False
    for i, (v, kind) in enumerate(zip(proc.vmas, proc.kinds, strict=True)):
        parts = cut(i, v, kind)
        changed = changed or len(parts) > 1 or parts[0][2] is not kind
        start, file_backed = v["start"], not v["flags"] & MAP_ANONYMOUS
        for a, b, k in parts:
            part = {**v, "start": a, "end": b}
            if file_backed:
                part["pgoff"] = v["pgoff"] + a - start
            new_vmas.append(part)
            new_kinds.append(k)
    if changed:
        proc.mm_img["entries"][0]["vmas"] = new_vmas
        proc.kinds = new_kinds
        proc.pieces = split(proc.pm_img["entries"][1:], new_vmas)
    return changed


def _cut_file_maps(proc: Proc) -> bool:
    """Keep, of each written file mapping, the in-file runs worth converting."""
    dirty: dict[int, list[tuple[int, int]]] = {}
    for p in proc.pieces:
        if p.vma is not None and p.src is not None and proc.kinds[p.vma] is Kind.FILE:
            dirty.setdefault(p.vma, []).append((p.start, p.end))

    def cut(i: int, v: dict[str, Any], kind: Kind) -> list[tuple[int, int, Kind]]:
        start, end = v["start"], v["end"]
        if kind is not Kind.FILE:
            return [(start, end, kind)]
        size = proc.sources[v["shmid"]][1]
        ranges = file_ranges(start, end, in_file_end(v, size), dirty.get(i, []))
        return [(a, b, Kind.FILE if conv else Kind.KEEP) for a, b, conv in ranges]

    return _reshape(proc, cut)


def _cut_mmapped_chunks(proc: Proc) -> bool:
    """Cut anonymous areas to convert at glibc mmapped-chunk boundaries.

    The kernel merges adjacent anonymous mmaps into one area. If such an area
    were one file slot, ``realloc`` growing one chunk by ``mremap`` would read
    the next chunk's bytes where anonymous memory reads zeros. With each chunk in
    its own slot, growth reads the slot's hole. A wrong guess only costs a cut.
    """
    starts = [p.start for p in proc.pieces]
    fd = os.open(proc.pages_path, os.O_RDONLY | os.O_CLOEXEC)

    def header(addr: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(starts, addr) - 1
        piece = proc.pieces[i] if i >= 0 else None
        if piece is None or piece.src is None or addr + 16 > piece.end:
            return None
        raw = os.pread(fd, 16, piece.src + addr - piece.start)
        return struct.unpack("<QQ", raw) if len(raw) == 16 else None

    def cut(i: int, v: dict[str, Any], kind: Kind) -> list[tuple[int, int, Kind]]:
        start, end = v["start"], v["end"]
        if kind is not Kind.CONVERT:
            return [(start, end, kind)]
        return [(a, b, kind) for a, b in glibc_chunks(header, start, end)]

    try:
        return _reshape(proc, cut)
    finally:
        os.close(fd)


def glibc_chunks(
    header: Callable[[int], tuple[int, int] | None], start: int, end: int
) -> list[tuple[int, int]]:
    """[start, end) cut into glibc mmapped chunks (prev_size 0, size with IS_MMAPPED), then the rest."""
    out, pos = [], start
    while pos < end:
        hdr = header(pos)
        if hdr is None:
            break
        prev_size, size = hdr
        total = size & ~0x7
        if (
            prev_size
            or not size & 0x2
            or size & 0x4
            or total == 0
            or total % PAGE
            or pos + total > end
        ):
            break
        out.append((pos, pos + total))
        pos += total
    if len(out) <= 1 and pos >= end:
        return [(start, end)]
    if pos < end:
        out.append((pos, end))
    return out
