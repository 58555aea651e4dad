"""CRIU images as the rewrite sees them: loading, saving, and page maps cut at VMA boundaries.

Images are read and written with pycriu (``python3-pycriu``) as dicts, fields by
name. They are loaded as pycriu does by default (not ``pretty``): numbers stay
integers, enums are their names. The constants are CRIU's and the kernel's (``criu/include/image.h``,
``linux/mman.h``).
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bunshin.errors import HostUnsupported

PAGE = 4096
SUFFIX = ".bunshin-mem"  # every memory file's name ends with it

# mmap prot and flags
PROT_WRITE, PROT_EXEC = 0x2, 0x4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MADV_WIPEONFORK = 18
# VmaEntry.status bits
VMA_AREA_REGULAR, VMA_AREA_HEAP, VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_ANON_PRIVATE = (
    0x1,
    0x20,
    0x40,
    0x80,
    0x200,
)
# PagemapEntry.flags
PE_PARENT, PE_LAZY, PE_PRESENT = 0x1, 0x2, 0x4


def _pycriu_images() -> Any:
    try:
        import pycriu.images as images
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise HostUnsupported(
            "pycriu is not importable", hint="install python3-pycriu with protobuf<6"
        ) from exc
    return images


def load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        img: dict[str, Any] = _pycriu_images().load(f)  # pretty=False: integers as integers
    return img


def save(img: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        _pycriu_images().dump(img, f)


def pids(images_dir: Path) -> list[int]:
    """The dumped processes (pids inside the dump), parents first."""
    return [e["pid"] for e in load(images_dir / "pstree.img")["entries"]]


def regular_files(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """files.img entries of regular files, by id."""
    return {e["id"]: e for e in entries if e.get("type") in ("REG", 1)}


def is_memfile_name(name: str) -> bool:
    return name.endswith(SUFFIX)


def referenced_memfiles(images_dir: Path) -> set[str]:
    """Names of the memory files a dump maps (as the restored tasks see them)."""
    files = regular_files(load(images_dir / "files.img")["entries"])
    return {e["reg"]["name"] for e in files.values() if is_memfile_name(str(e["reg"]["name"]))}


# ------------------------------------------------------------------ page maps


def pages_present(entry: dict[str, Any]) -> tuple[int, bool]:
    """(number of pages, whether they are stored in the pages image)."""
    n = entry.get("nr_pages", entry.get("compat_nr_pages", 0))
    if "flags" in entry:
        return n, bool(entry["flags"] & PE_PRESENT)
    return n, not entry.get("in_parent", False)


def set_pages(entry: dict[str, Any], n: int) -> None:
    if "nr_pages" in entry:
        entry["nr_pages"] = n
        entry["compat_nr_pages"] = 0
    else:
        entry["compat_nr_pages"] = n


@dataclass
class Piece:
    """A run of pages of one page-map entry that lies in one VMA (or in none)."""

    start: int
    end: int
    src: int | None  # offset in the pages image, None if not stored there
    entry: dict[str, Any]  # the page-map entry it came from
    vma: int | None


def split(entries: list[dict[str, Any]], vmas: list[dict[str, Any]]) -> list[Piece]:
    """Cut page-map entries at VMA boundaries (entries can span several VMAs)."""
    starts = [v["start"] for v in vmas]
    pieces, src = [], 0
    for entry in entries:
        n, present = pages_present(entry)
        pos, end = entry["vaddr"], entry["vaddr"] + n * PAGE
        base_src, base_pos = src, pos
        while pos < end:
            i = bisect.bisect_right(starts, pos) - 1
            if i >= 0 and pos < vmas[i]["end"]:
                cut, idx = min(end, vmas[i]["end"]), i
            else:
                nxt = starts[i + 1] if i + 1 < len(starts) else end
                cut, idx = min(end, nxt), None
            pieces.append(
                Piece(pos, cut, base_src + pos - base_pos if present else None, entry, idx)
            )
            pos = cut
        if present:
            src += n * PAGE
    return pieces


def append_entry(entries: list[dict[str, Any]], p: Piece) -> None:
    """Add a piece to a new page map, merging it into the previous entry when contiguous."""
    flags = p.entry.get("flags")
    if entries:
        last = entries[-1]
        n_last, present_last = pages_present(last)
        if (
            last["vaddr"] + n_last * PAGE == p.start
            and last.get("flags") == flags
            and last.get("in_parent") == p.entry.get("in_parent")
            and present_last == (p.src is not None)
        ):
            set_pages(last, n_last + (p.end - p.start) // PAGE)
            return
    e = dict(p.entry)
    e["vaddr"] = p.start
    set_pages(e, (p.end - p.start) // PAGE)
    entries.append(e)


def stored_bytes(pieces: list[Piece]) -> tuple[dict[int, int], set[int]]:
    """Per VMA: bytes stored in the pages image; VMAs with pages stored elsewhere."""
    stored: dict[int, int] = {}
    missing: set[int] = set()
    for p in pieces:
        if p.vma is not None:
            if p.src is None:
                missing.add(p.vma)
            else:
                stored[p.vma] = stored.get(p.vma, 0) + p.end - p.start
    return stored, missing


def dumped_command(images: Path, pid: int) -> str:
    """The command line of dumped process ``pid`` (its argument area in the dump), or its name
    (control characters shown as ``?``: it goes into messages)."""
    text = _dumped_command(images, pid)
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _dumped_command(images: Path, pid: int) -> str:
    try:
        core = load(images / f"core-{pid}.img")["entries"][0]
        name = str(core.get("tc", {}).get("comm", "?"))
    except (OSError, KeyError, IndexError):
        return "?"
    with contextlib.suppress(OSError, KeyError, IndexError, ValueError):
        mm = load(images / f"mm-{pid}.img")["entries"][0]
        args = _read(images, pid, int(mm["mm_arg_start"]), int(mm["mm_arg_end"]))
        if args:
            return args.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")[:200]
    return name


def _read(images: Path, pid: int, start: int, end: int) -> bytes | None:
    """Bytes [start, end) of the process's dumped private pages (None if not all stored)."""
    if not 0 < end - start <= 1 << 16:
        return None
    pm = load(images / f"pagemap-{pid}.img")["entries"]
    pages = images / f"pages-{pm[0]['pages_id']}.img"
    off = 0
    for e in pm[1:]:
        n = int(e.get("nr_pages", 0))
        lo, hi = int(e["vaddr"]), int(e["vaddr"]) + n * PAGE
        stored = bool(int(e.get("flags", PE_PRESENT)) & PE_PRESENT)
        if stored and lo <= start and end <= hi:
            with open(pages, "rb") as f:
                f.seek(off + start - lo)
                return f.read(end - start)
        off += n * PAGE if stored else 0
    return None
