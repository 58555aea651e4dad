"""Rewrite a CRIU dump so that its restores share memory copy-on-write.

For each dumped process, every private anonymous area that has pages in the
image is written into a sparse *memory file* on tmpfs (one file per process and
rewrite) and turned into a private mapping of that file; its pages leave the
image. Each restore then maps the file ``MAP_PRIVATE``: all clones read the one
copy in the page cache, and a write copies a single page into the writer.

Layout: every converted area gets its own slot in the file, followed by
``growth_room`` bytes of hole, so ``mremap`` growth (in place or moved) reads
zeros, as it would in anonymous memory, never a neighbour's bytes. The kernel
merges adjacent anonymous mmaps into one area, so areas are first cut at glibc
mmapped-chunk boundaries (``realloc`` grows such a chunk with ``mremap``). Slots
keep the area's address modulo 2 MiB, so a tmpfs mounted with ``huge=`` can use
huge pages. A memory file never changes once written (mode 0444 and, where the
filesystem allows, the immutable flag): CRIU checks only its size. It must
outlive every dump and clone that maps it (``referenced_memfiles``); delete it
with ``remove_memfile``. Its pages are charged to the memory cgroup of whoever
wrote or first faulted them, not to the clones.

Forks of forks: a clone's memory is already file-backed, so CRIU dumps only the
pages the clone wrote (a *delta*, kept in the image and restored privately into
each clone); those areas keep pointing at their memory file. New anonymous
areas are converted into a new file. When a delta grows beyond ``rebase_ratio``
times the data the areas map from their file, the areas are *rebased*: a fresh
file gets the old file's data with the delta on top, and the delta leaves the
image.

Semantic differences from anonymous memory, and how they are handled:

- ``MADV_DONTNEED`` on a converted area brings back the file's bytes (the
  dump-time contents), not zeros. glibc's malloc never relies on zeros there
  (``calloc`` clears everything below a heap's ``mprotect_size``; memory above
  it was never written, so the file holds a hole). jemalloc does rely on it
  (a forced purge marks the extent zeroed, a later ``calloc`` skips the
  memset), and so may mimalloc. A process that maps ``libjemalloc`` or
  ``libmimalloc``, or whose executable or libraries contain jemalloc
  (``<jemalloc>`` in the file: static linking, as Redis and many Rust programs
  do), is handled by ``zero_fill``: ``COPY`` (default) leaves its memory
  anonymous (plain CRIU copy: correct, not shared), ``REFUSE`` raises
  ``NotForkable``, ``CONVERT`` converts it anyway. Code that purges memory
  with ``MADV_DONTNEED`` itself and expects zeros (some JIT or wasm runtimes)
  is not detected.
- ``MADV_FREE`` fails with EINVAL on a converted area (callers fall back).
- A clone's first touch of a hole (memory never written before the dump,
  growth room) allocates a zero page in the shared file, once for all clones.
- ``[heap]`` stays anonymous unless ``convert_heap``: converting it loses the
  label and mixes brk shrink/regrow with a file mapping.
- Only plain private anonymous areas are converted (flags within
  MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE, no CRIU status bit but regular and
  anon-private, no ``MADV_WIPEONFORK``): stacks (``MAP_GROWSDOWN``),
  ``MAP_DROPPABLE``, hugetlb, vdso/vvar/vsyscall, shared and SysV memory stay
  as they are.
- ``/proc/PID/maps`` shows the memory file's name for converted areas.
"""

from __future__ import annotations

import bisect
import contextlib
import enum
import errno
import fcntl
import functools
import mmap
import os
import re
import struct
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunshin.errors import HostUnsupported, InvalidArgument, NotForkable, RuntimeFailure

PAGE = 4096
HUGE = 2 << 20
SUFFIX = ".bunshin-mem"
DEFAULT_GROWTH_ROOM = 1 << 40

# mmap flags, CRIU VMA status bits, page-map entry flags (criu/include/image.h)
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
_CONVERTIBLE_FLAGS = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
VMA_AREA_REGULAR, VMA_AREA_HEAP, VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_ANON_PRIVATE = (
    0x1,
    0x20,
    0x40,
    0x80,
    0x200,
)
PE_PARENT, PE_LAZY, PE_PRESENT = 0x1, 0x2, 0x4
MADV_WIPEONFORK = 18

_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10

_RISKY_LIBS = re.compile(r"/lib(jemalloc|mimalloc)[^/]*\.so")
_JEMALLOC_MARK = b"<jemalloc>"
_SCAN_LIMIT = 1 << 30
PROT_EXEC = 0x4


class ZeroFillPolicy(enum.Enum):
    """What to do with a process whose allocator relies on MADV_DONTNEED zero-fill."""

    COPY = "copy"  # leave its memory anonymous: restored by copy, correct, not shared
    REFUSE = "refuse"  # raise NotForkable
    CONVERT = "convert"  # convert anyway (the caller vouches for the process)


@dataclass(frozen=True)
class MemFile:
    """A memory file written by a rewrite."""

    path: Path
    pid: int  # the process (pid inside the dump) whose areas it holds
    vmas: int
    data_bytes: int  # bytes written (the file is sparse)
    size: int  # logical size, growth room included


@dataclass(frozen=True)
class Unconverted:
    """A process whose memory was left anonymous, and why."""

    pid: int
    reason: str


@dataclass(frozen=True)
class RewriteResult:
    files: tuple[MemFile, ...]
    vmas_converted: int  # anonymous areas turned into memory-file mappings
    vmas_rebased: int  # memory-file areas moved to a fresh file with their delta
    vmas_shared: int  # memory-file areas kept pointing at their file
    bytes_moved: int  # page bytes moved from the image into memory files
    delta_bytes: int  # pages left in the image inside memory-file areas
    image_bytes: int  # all page bytes left in the image
    left_anonymous: tuple[Unconverted, ...]
    duration_ms: float

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


# --------------------------------------------------------------------- images


def _pycriu_images() -> Any:
    try:
        import pycriu.images as images  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the host
        raise HostUnsupported(
            "pycriu is not importable", hint="install python3-pycriu with protobuf<6"
        ) from exc
    return images


def _load(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return _pycriu_images().load(f)


def _dump(img: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        _pycriu_images().dump(img, f)


def _num(value: Any) -> int:
    """An integer field; pycriu renders some as strings ("0x22", "MAP_PRIVATE | MAP_ANON")."""
    if isinstance(value, int):
        return value
    from pycriu.images import pb2dict  # type: ignore[import-not-found]

    names: dict[str, int] = {}
    for table in pb2dict.flags_maps.values():
        names.update(dict(table))
    return sum(
        names[p] if p in names else int(p, 0)
        for p in (s.strip() for s in str(value).split("|"))
        if p
    )


def _pages_present(entry: dict[str, Any]) -> tuple[int, bool]:
    """(number of pages, whether they are stored in the pages image)."""
    n = _num(entry.get("nr_pages", entry.get("compat_nr_pages", 0)))
    if "flags" in entry:
        return n, bool(_num(entry["flags"]) & PE_PRESENT)
    return n, not entry.get("in_parent", False)


def _pids(images_dir: Path) -> list[int]:
    return [_num(e["pid"]) for e in _load(images_dir / "pstree.img")["entries"]]


def referenced_memfiles(images_dir: Path) -> set[str]:
    """Names of the memory files a dump maps (as the restored tasks see them)."""
    return {
        e["reg"]["name"] for e in _load(images_dir / "files.img")["entries"] if _is_memfile_entry(e)
    }


def _is_memfile_entry(entry: dict[str, Any]) -> bool:
    return entry.get("type") in ("REG", 1) and str(entry.get("reg", {}).get("name", "")).endswith(
        SUFFIX
    )


# ------------------------------------------------------------ zero-fill risk


@functools.lru_cache(maxsize=4096)
def _file_contains(path: str, needle: bytes, _key: tuple[int, int, int, int]) -> bool:
    try:
        with (
            open(path, "rb") as f,
            mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m,
        ):
            return m.find(needle) >= 0
    except (OSError, ValueError):
        return False


def _mapped_names(
    mm: dict[str, Any], files: dict[int, dict[str, Any]], *, exec_only: bool = False
) -> set[str]:
    """Names of the files a process maps (its executable included)."""
    ids = {_num(mm.get("exe_file_id", 0))}
    for v in mm.get("vmas", []):
        if _num(v["status"]) & (VMA_FILE_PRIVATE | VMA_FILE_SHARED) and (
            not exec_only or _num(v["prot"]) & PROT_EXEC
        ):
            ids.add(_num(v["shmid"]))
    return {files[i]["reg"]["name"] for i in ids if i in files and "reg" in files[i]}


def _zero_fill_reason(
    mm: dict[str, Any], files: dict[int, dict[str, Any]], root: Path
) -> str | None:
    for name in sorted(_mapped_names(mm, files)):
        if _RISKY_LIBS.search(name):
            return f"maps {name} (its allocator expects MADV_DONTNEED to zero memory)"
    for name in sorted(_mapped_names(mm, files, exec_only=True)):
        path = root / name.lstrip("/")
        try:
            st = path.stat()
        except OSError:
            continue
        # code files only: never read a (huge, sparse) memory file
        if name.endswith(SUFFIX) or not path.is_file() or st.st_size > _SCAN_LIMIT:
            continue
        if _file_contains(
            str(path), _JEMALLOC_MARK, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        ):
            return f"{name} contains jemalloc (it expects MADV_DONTNEED to zero memory)"
    return None


def zero_fill_risks(images_dir: Path, *, root: Path = Path("/")) -> dict[int, str]:
    """Processes of a dump whose allocator relies on MADV_DONTNEED zero-fill, with the reason.

    ``root``: where the dumped tasks' file names resolve (the workspace's root).
    """
    files = _files_by_id(_load(images_dir / "files.img")["entries"])
    risks = {}
    for pid in _pids(images_dir):
        mm_path = images_dir / f"mm-{pid}.img"
        if mm_path.exists():
            reason = _zero_fill_reason(_load(mm_path)["entries"][0], files, root)
            if reason:
                risks[pid] = reason
    return risks


def _files_by_id(entries: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {_num(e["id"]): e for e in entries if e.get("type") in ("REG", 1)}


# ---------------------------------------------------------------- file I/O


def _copy(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
    """Copy n bytes between file offsets: copy_file_range, else sendfile (across filesystems)."""
    try:
        while n > 0:
            done = os.copy_file_range(src, dst, n, src_off, dst_off)
            if done <= 0:
                raise OSError(errno.EIO, "short copy_file_range")
            src_off, dst_off, n = src_off + done, dst_off + done, n - done
        return
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EIO):
            raise
    os.lseek(dst, dst_off, os.SEEK_SET)
    while n > 0:
        done = os.sendfile(dst, src, src_off, n)
        if done <= 0:
            raise RuntimeFailure("unexpected end of file while copying pages")
        src_off, n = src_off + done, n - done


def _data_extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The (offset, length) ranges of [start, end) that hold data (SEEK_DATA/SEEK_HOLE)."""
    pos = start
    while pos < end:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return
            raise
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole - data
        pos = hole


def _seal(fd: int) -> None:
    """Make a finished memory file read-only and, where supported, immutable."""
    os.fchmod(fd, 0o444)
    with contextlib.suppress(OSError):
        buf = bytearray(struct.pack("i", 0))
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
        flags = struct.unpack("i", buf)[0] | _FS_IMMUTABLE_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, bytearray(struct.pack("i", flags)))


def remove_memfile(path: Path) -> None:
    """Delete a memory file (clearing its immutable flag first); missing is fine."""
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with contextlib.suppress(OSError):
                buf = bytearray(struct.pack("i", 0))
                fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
                flags = struct.unpack("i", buf)[0]
                if flags & _FS_IMMUTABLE_FL:
                    fcntl.ioctl(
                        fd, _FS_IOC_SETFLAGS, bytearray(struct.pack("i", flags & ~_FS_IMMUTABLE_FL))
                    )
        finally:
            os.close(fd)
        path.unlink()


def remove_memfiles(directory: Path, *, keep: Iterable[Path] = ()) -> list[Path]:
    """Delete every memory file in a directory except ``keep``; returns what was removed."""
    kept = {Path(p).resolve() for p in keep}
    removed = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        if path.resolve() not in kept:
            remove_memfile(path)
            removed.append(path)
    return removed


# --------------------------------------------------------------- the rewrite


class _Kind(enum.Enum):
    KEEP = 0
    CONVERT = 1  # anonymous -> new memory file
    SHARED = 2  # already a memory-file mapping: keep, its pages are a delta
    REBASE = 3  # memory-file mapping -> new memory file (base data + delta)


@dataclass
class _Piece:
    start: int
    end: int
    src: int | None  # offset in the pages image, None if not stored there
    entry: dict[str, Any]  # the page-map entry it came from
    vma: int | None


@dataclass
class _Proc:
    pid: int
    mm_img: dict[str, Any]
    pm_img: dict[str, Any]
    pages_path: Path
    kinds: list[_Kind]
    pieces: list[_Piece]
    base_paths: dict[int, Path] = field(
        default_factory=dict
    )  # shmid -> host path of its memory file

    @property
    def vmas(self) -> list[dict[str, Any]]:
        return self.mm_img["entries"][0]["vmas"]


def _convertible(vma: dict[str, Any], convert_heap: bool) -> bool:
    """A plain private anonymous area (whitelists: anything unusual stays as it is)."""
    flags, status = _num(vma["flags"]), _num(vma["status"])
    if flags & ~_CONVERTIBLE_FLAGS or not flags & MAP_ANONYMOUS or not flags & MAP_PRIVATE:
        return False
    allowed = VMA_AREA_REGULAR | VMA_ANON_PRIVATE | (VMA_AREA_HEAP if convert_heap else 0)
    if status & ~allowed or not status & VMA_ANON_PRIVATE:
        return False
    return not _num(vma.get("madv", 0)) & (1 << MADV_WIPEONFORK)


def _split(entries: list[dict[str, Any]], vmas: list[dict[str, Any]]) -> list[_Piece]:
    """Cut page-map entries at VMA boundaries."""
    starts = [_num(v["start"]) for v in vmas]
    pieces, src = [], 0
    for entry in entries:
        n, present = _pages_present(entry)
        pos, end = _num(entry["vaddr"]), _num(entry["vaddr"]) + n * PAGE
        base_src, base_pos = src, pos
        while pos < end:
            i = bisect.bisect_right(starts, pos) - 1
            if i >= 0 and pos < _num(vmas[i]["end"]):
                cut, idx = min(end, _num(vmas[i]["end"])), i
            else:
                nxt = starts[i + 1] if i + 1 < len(starts) else end
                cut, idx = min(end, nxt), None
            pieces.append(
                _Piece(pos, cut, base_src + pos - base_pos if present else None, entry, idx)
            )
            pos = cut
        if present:
            src += n * PAGE
    return pieces


def _host_path(name: str, memfile_dir: Path, view: str) -> Path | None:
    if not name.endswith(SUFFIX):
        return None
    if name.startswith(view.rstrip("/") + "/"):
        return memfile_dir / name[len(view.rstrip("/")) + 1 :]
    return None


def _plan(
    images_dir: Path,
    pid: int,
    files: dict[int, dict[str, Any]],
    *,
    convert_heap: bool,
    rebase_ratio: float | None,
    memfile_dir: Path,
    view: str,
    split_chunks: bool,
    convert: bool,
) -> _Proc | None:
    """Classify one process's areas; None if it has no memory of its own."""
    mm_path = images_dir / f"mm-{pid}.img"
    pm_path = images_dir / f"pagemap-{pid}.img"
    if not mm_path.exists() or not pm_path.exists():
        return None  # a zombie, or memory shared with another task
    mm_img, pm_img = _load(mm_path), _load(pm_path)
    vmas = mm_img["entries"][0].get("vmas", [])
    head, entries = pm_img["entries"][0], pm_img["entries"][1:]
    proc = _Proc(
        pid,
        mm_img,
        pm_img,
        images_dir / f"pages-{_num(head['pages_id'])}.img",
        [_Kind.KEEP] * len(vmas),
        _split(entries, vmas),
    )
    stored, missing = _stored_bytes(proc.pieces)
    for i, v in enumerate(vmas):
        status = _num(v["status"])
        if status & VMA_FILE_PRIVATE and not _num(v["flags"]) & MAP_ANONYMOUS:
            reg = files.get(_num(v["shmid"]), {}).get("reg", {})
            host = _host_path(str(reg.get("name", "")), memfile_dir, view)
            if str(reg.get("name", "")).endswith(SUFFIX):
                proc.kinds[i] = _Kind.SHARED
                if host is not None:
                    proc.base_paths[_num(v["shmid"])] = host
        elif convert and i in stored and i not in missing and _convertible(v, convert_heap):
            proc.kinds[i] = _Kind.CONVERT
    if convert and split_chunks and _split_mmapped_chunks(proc):
        stored, missing = _stored_bytes(proc.pieces)
    if convert and rebase_ratio is not None:
        _choose_rebase(proc, stored, missing, rebase_ratio)
    return proc


def _stored_bytes(pieces: list[_Piece]) -> tuple[dict[int, int], set[int]]:
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


def _split_mmapped_chunks(proc: _Proc) -> bool:
    """Split areas to convert at glibc mmapped-chunk boundaries; True if any was split.

    The kernel merges adjacent anonymous mmaps into one area. If such an area
    were one file slot, ``realloc`` growing one chunk by ``mremap`` would read
    the next chunk's bytes where anonymous memory reads zeros. With each chunk in
    its own slot, growth reads the slot's hole. A wrong guess only costs a split.
    """
    starts = [p.start for p in proc.pieces]
    fd = os.open(proc.pages_path, os.O_RDONLY | os.O_CLOEXEC)

    def header(addr: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or proc.pieces[i].src is None or addr + 16 > proc.pieces[i].end:
            return None
        raw = os.pread(fd, 16, proc.pieces[i].src + addr - proc.pieces[i].start)  # type: ignore[operator]
        return struct.unpack("<QQ", raw) if len(raw) == 16 else None

    new_vmas: list[dict[str, Any]] = []
    new_kinds: list[_Kind] = []
    try:
        for v, kind in zip(proc.vmas, proc.kinds, strict=True):
            start, end = _num(v["start"]), _num(v["end"])
            ranges = _glibc_chunks(header, start, end) if kind is _Kind.CONVERT else [(start, end)]
            for a, b in ranges:
                new_vmas.append({**v, "start": a, "end": b})
                new_kinds.append(kind)
    finally:
        os.close(fd)
    if len(new_vmas) == len(proc.vmas):
        return False
    entries = proc.pm_img["entries"][1:]
    proc.mm_img["entries"][0]["vmas"] = new_vmas
    proc.kinds = new_kinds
    proc.pieces = _split(entries, new_vmas)
    return True


def _glibc_chunks(header: Any, start: int, end: int) -> list[tuple[int, int]]:
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


def _choose_rebase(proc: _Proc, stored: dict[int, int], missing: set[int], ratio: float) -> None:
    """Mark memory-file areas for rebase where their delta is large relative to their data."""
    by_file: dict[int, list[int]] = {}
    for i, kind in enumerate(proc.kinds):
        shmid = _num(proc.vmas[i]["shmid"])
        if kind is _Kind.SHARED and shmid in proc.base_paths and i not in missing:
            by_file.setdefault(shmid, []).append(i)
    for shmid, idxs in by_file.items():
        delta = sum(stored.get(i, 0) for i in idxs)
        if delta == 0:
            continue
        try:
            fd = os.open(proc.base_paths[shmid], os.O_RDONLY)
        except OSError:
            continue
        try:
            base = 0
            for i in idxs:
                v = proc.vmas[i]
                off = _num(v["pgoff"])
                base += sum(
                    n for _, n in _data_extents(fd, off, off + _num(v["end"]) - _num(v["start"]))
                )
        finally:
            os.close(fd)
        if delta >= ratio * base:
            for i in idxs:
                proc.kinds[i] = _Kind.REBASE


class _Slots:
    """Places areas in a new memory file, each followed by growth room."""

    def __init__(self, growth_room: int) -> None:
        self.cursor = 0
        self.growth_room = growth_room

    def place(self, start: int, length: int) -> int:
        off = -(-self.cursor // HUGE) * HUGE + start % HUGE
        self.cursor = off + length + self.growth_room
        return off


def _execute(
    proc: _Proc,
    memfile_path: Path,
    view_name: str,
    file_id: int,
    mnt_id: int | None,
    growth_room: int,
    created: list[Path],
) -> tuple[MemFile | None, dict[str, Any] | None, dict[str, int]]:
    """Write the memory file and the new page map/pages for one process (to temp names)."""
    stats = {"converted": 0, "rebased": 0, "shared": 0, "moved": 0, "delta": 0, "kept": 0}
    new_file = any(k in (_Kind.CONVERT, _Kind.REBASE) for k in proc.kinds)
    slots, offsets = _Slots(growth_room), {}
    for i, kind in enumerate(proc.kinds):
        if kind in (_Kind.CONVERT, _Kind.REBASE):
            v = proc.vmas[i]
            offsets[i] = slots.place(_num(v["start"]), _num(v["end"]) - _num(v["start"]))
    if not new_file:
        stats["shared"] = proc.kinds.count(_Kind.SHARED)
        for p in proc.pieces:
            if p.src is not None:
                stats["kept"] += p.end - p.start
                if p.vma is not None and proc.kinds[p.vma] is _Kind.SHARED:
                    stats["delta"] += p.end - p.start
        return None, None, stats

    mem_fd = os.open(memfile_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    created.append(memfile_path)
    src_fd = os.open(proc.pages_path, os.O_RDONLY | os.O_CLOEXEC)
    tmp_pages = proc.pages_path.with_name(proc.pages_path.name + ".rewrite")
    out_fd = os.open(tmp_pages, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    created.append(tmp_pages)
    data = 0
    try:
        # rebased areas start from their old file's data
        for i, kind in enumerate(proc.kinds):
            if kind is _Kind.REBASE:
                v = proc.vmas[i]
                base_fd = os.open(proc.base_paths[_num(v["shmid"])], os.O_RDONLY | os.O_CLOEXEC)
                try:
                    pgoff = _num(v["pgoff"])
                    for off, n in _data_extents(
                        base_fd, pgoff, pgoff + _num(v["end"]) - _num(v["start"])
                    ):
                        _copy(base_fd, off, mem_fd, offsets[i] + off - pgoff, n)
                finally:
                    os.close(base_fd)
        entries: list[dict[str, Any]] = []
        out_off = 0
        for p in proc.pieces:
            kind = proc.kinds[p.vma] if p.vma is not None else _Kind.KEEP
            n = p.end - p.start
            if p.src is not None and kind in (_Kind.CONVERT, _Kind.REBASE):
                v = proc.vmas[p.vma]  # type: ignore[index]
                _copy(src_fd, p.src, mem_fd, offsets[p.vma] + p.start - _num(v["start"]), n)  # type: ignore[index]
                stats["moved"] += n
                continue
            if p.src is not None:
                _copy(src_fd, p.src, out_fd, out_off, n)
                out_off += n
                stats["kept"] += n
                if kind is _Kind.SHARED:
                    stats["delta"] += n
            _append_entry(entries, p)
        os.ftruncate(mem_fd, slots.cursor)
        _seal(mem_fd)
        data = os.fstat(mem_fd).st_blocks * 512
    finally:
        os.close(mem_fd)
        os.close(src_fd)
        os.close(out_fd)

    nvmas = 0
    for i, kind in enumerate(proc.kinds):
        v = proc.vmas[i]
        if kind is _Kind.SHARED:
            stats["shared"] += 1
        if kind not in (_Kind.CONVERT, _Kind.REBASE):
            continue
        stats["converted" if kind is _Kind.CONVERT else "rebased"] += 1
        nvmas += 1
        v["flags"] = _num(v["flags"]) & ~MAP_ANONYMOUS
        v["status"] = VMA_AREA_REGULAR | VMA_FILE_PRIVATE
        v["shmid"] = file_id
        v["pgoff"] = offsets[i]
        v["fd"] = -1
        v["fdflags"] = os.O_RDONLY
    proc.pm_img["entries"] = [proc.pm_img["entries"][0], *entries]
    reg: dict[str, Any] = {
        "id": file_id,
        "flags": os.O_RDONLY,
        "pos": 0,
        "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
        "name": view_name,
        "size": slots.cursor,
        "mode": 0o100444,
    }
    if mnt_id is not None:
        reg["mnt_id"] = mnt_id
    memfile = MemFile(memfile_path, proc.pid, nvmas, data, slots.cursor)
    return memfile, {"type": "REG", "id": file_id, "reg": reg}, stats


def _append_entry(entries: list[dict[str, Any]], p: _Piece) -> None:
    """Add a piece to the new page map, merging it into the previous entry when contiguous."""
    flags = p.entry.get("flags")
    if entries:
        last = entries[-1]
        n_last, present_last = _pages_present(last)
        if (
            _num(last["vaddr"]) + n_last * PAGE == p.start
            and last.get("flags") == flags
            and last.get("in_parent") == p.entry.get("in_parent")
            and present_last == (p.src is not None)
        ):
            _set_pages(last, n_last + (p.end - p.start) // PAGE)
            return
    e = dict(p.entry)
    e["vaddr"] = p.start
    _set_pages(e, (p.end - p.start) // PAGE)
    entries.append(e)


def _set_pages(entry: dict[str, Any], n: int) -> None:
    if "nr_pages" in entry:
        entry["nr_pages"] = n
        entry["compat_nr_pages"] = 0
    else:
        entry["compat_nr_pages"] = n


def rewrite_images(
    images_dir: Path,
    memfile_dir: Path,
    *,
    convert_heap: bool = False,
    zero_fill: ZeroFillPolicy = ZeroFillPolicy.COPY,
    rebase_ratio: float | None = 0.5,
    growth_room: int = DEFAULT_GROWTH_ROOM,
    memfile_view: str | None = None,
    root: Path = Path("/"),
    tag: str | None = None,
    split_chunks: bool = True,
) -> RewriteResult:
    """Move the dump's private anonymous memory into memory files (see the module doc).

    ``memfile_dir``: a tmpfs directory for the new files. ``memfile_view``: that
    directory's path as the restored tasks see it (default: the same path).
    ``rebase_ratio``: rebase a process's areas of one memory file when their delta
    reaches this fraction of the data they map from it (None: never). ``root``:
    where the tasks' file names resolve, to look for risky allocators. ``tag``:
    prefix of the new files' names (default: random). ``split_chunks``: give each
    glibc mmapped chunk its own slot (see ``_split_mmapped_chunks``). On failure
    the images are left unchanged and no new file is left behind.
    """
    t0 = time.monotonic()
    images_dir, memfile_dir = Path(images_dir), Path(memfile_dir)
    if not (images_dir / "pstree.img").exists():
        raise InvalidArgument(f"{images_dir} holds no CRIU dump (no pstree.img)")
    if growth_room < 0 or growth_room % PAGE:
        raise InvalidArgument("growth_room must be a non-negative multiple of the page size")
    memfile_dir.mkdir(parents=True, exist_ok=True)
    view = memfile_view or str(memfile_dir)
    tag = tag or uuid.uuid4().hex[:12]
    files_img = _load(images_dir / "files.img")
    files = _files_by_id(files_img["entries"])
    next_id = max((_num(e["id"]) for e in files_img["entries"]), default=0) + 1

    risks = {} if zero_fill is ZeroFillPolicy.CONVERT else zero_fill_risks(images_dir, root=root)
    if risks and zero_fill is ZeroFillPolicy.REFUSE:
        pid, reason = sorted(risks.items())[0]
        raise NotForkable(
            f"process {pid} of the dump {reason}",
            hint="fork it by copy (zero_fill=COPY) or vouch for it (zero_fill=CONVERT)",
            pid=pid,
        )

    created: list[Path] = []
    renames: list[tuple[Path, Path]] = []
    memfiles: list[MemFile] = []
    totals = {"converted": 0, "rebased": 0, "shared": 0, "moved": 0, "delta": 0, "kept": 0}
    try:
        for pid in _pids(images_dir):
            proc = _plan(
                images_dir,
                pid,
                files,
                convert_heap=convert_heap,
                rebase_ratio=rebase_ratio,
                memfile_dir=memfile_dir,
                view=view,
                split_chunks=split_chunks,
                convert=pid not in risks,
            )
            if proc is None:
                continue
            name = f"{tag}-{pid}{SUFFIX}"
            exe = files.get(_num(proc.mm_img["entries"][0].get("exe_file_id", 0)), {}).get(
                "reg", {}
            )
            mnt_id = _num(exe["mnt_id"]) if "mnt_id" in exe else None
            memfile, entry, stats = _execute(
                proc,
                memfile_dir / name,
                f"{view.rstrip('/')}/{name}",
                next_id,
                mnt_id,
                growth_room,
                created,
            )
            for k, v in stats.items():
                totals[k] += v
            if memfile is None or entry is None:
                continue
            memfiles.append(memfile)
            files_img["entries"].append(entry)
            next_id += 1
            for img, path in (
                (proc.mm_img, images_dir / f"mm-{pid}.img"),
                (proc.pm_img, images_dir / f"pagemap-{pid}.img"),
            ):
                tmp = path.with_name(path.name + ".rewrite")
                created.append(tmp)
                _dump(img, tmp)
                renames.append((tmp, path))
            renames.append(
                (proc.pages_path.with_name(proc.pages_path.name + ".rewrite"), proc.pages_path)
            )
        if memfiles:
            tmp = images_dir / "files.img.rewrite"
            created.append(tmp)
            _dump(files_img, tmp)
            renames.append((tmp, images_dir / "files.img"))
    except BaseException:
        for path in created:
            remove_memfile(path)
        raise
    for tmp, path in renames:
        os.replace(tmp, path)
    return RewriteResult(
        files=tuple(memfiles),
        vmas_converted=totals["converted"],
        vmas_rebased=totals["rebased"],
        vmas_shared=totals["shared"],
        bytes_moved=totals["moved"],
        delta_bytes=totals["delta"],
        image_bytes=totals["kept"],
        left_anonymous=tuple(Unconverted(pid, r) for pid, r in sorted(risks.items())),
        duration_ms=(time.monotonic() - t0) * 1000,
    )


def rebase(images_dir: Path, memfile_dir: Path, **kwargs: Any) -> RewriteResult:
    """``rewrite_images`` that rebases every memory-file area holding a delta."""
    kwargs["rebase_ratio"] = 0.0
    return rewrite_images(images_dir, memfile_dir, **kwargs)
