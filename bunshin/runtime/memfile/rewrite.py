"""Executing a rewrite: memory files written, images replaced, all or nothing."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bunshin.errors import InvalidArgument, NotForkable

from ..kernel.syscalls import punch_hole
from . import trap
from .criu_images import (
    MAP_ANONYMOUS,
    PAGE,
    SUFFIX,
    VMA_AREA_REGULAR,
    VMA_FILE_PRIVATE,
    append_entry,
    dumped_command,
    load,
    pids,
    regular_files,
    save,
)
from .fileio import copy_range, remove_memfile, seal, write_data
from .filemaps import FileSources
from .plan import NEW_SLOT, Kind, Proc, plan
from .rebasing import copy_base
from .trapcode import build_blob
from .zerofill import ZeroFillPolicy, zero_fill_risks

HUGE = 2 << 20
DEFAULT_GROWTH_ROOM = 1 << 40


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
    """A process whose anonymous memory was left anonymous, and why."""

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
    vmas_file: int = 0  # written private file mappings turned into memory-file mappings
    zero_bytes: int = 0  # of bytes_moved, all-zero pages left as holes
    file_bytes: int = 0  # bytes copied from the original files of those mappings
    trap_bytes: int = 0  # the SIGSYS handler's code, table and state written (``trap``)
    processes_trapped: int = 0  # processes given the handler or a new filter for it

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)


@dataclass
class _Totals:
    converted: int = 0
    file: int = 0
    rebased: int = 0
    shared: int = 0
    moved: int = 0
    zero: int = 0
    file_bytes: int = 0
    trap_bytes: int = 0
    delta: int = 0
    kept: int = 0

    def add(self, other: _Totals) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class Slots:
    """Places areas in a new memory file, each followed by ``growth_room`` bytes of hole.

    A slot keeps its area's address modulo 2 MiB, so a tmpfs mounted with
    ``huge=`` can back it with huge pages.
    """

    def __init__(self, growth_room: int) -> None:
        self.cursor = 0
        self.growth_room = growth_room

    def place(self, start: int, length: int) -> int:
        off = -(-self.cursor // HUGE) * HUGE + start % HUGE
        self.cursor = off + length + self.growth_room
        return off


def _gaps(start: int, end: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of [start, end) outside the sorted, disjoint ``covered`` ranges."""
    out, pos = [], start
    for a, b in covered:
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        out.append((pos, end))
    return out


def _fill_base(proc: Proc, offsets: dict[int, int], mem_fd: int, totals: _Totals) -> None:
    """Write what rebased and file areas hold outside the dumped pages into their slots."""
    covered: dict[int, list[tuple[int, int]]] = {}
    for p in proc.pieces:
        if p.vma in offsets and p.src is not None:
            covered.setdefault(p.vma, []).append((p.start, p.end))
    for i, slot in offsets.items():
        v, kind = proc.vmas[i], proc.kinds[i]
        start, end = v["start"], v["end"]
        gaps = _gaps(start, end, covered.get(i, []))
        if kind is Kind.REBASE:
            copy_base(proc.base_paths[v["shmid"]], v, gaps, mem_fd, slot)
        elif kind is Kind.FILE:
            fd, size = proc.sources[v["shmid"]]
            for a, b in gaps:
                totals.file_bytes += write_data(
                    fd, v["pgoff"] + a - start, mem_fd, slot + a - start, b - a, src_end=size
                )
        elif kind is Kind.TRAP:
            data = proc.trap[i].rstrip(b"\0")
            data = data.ljust(-(-len(data) // PAGE) * PAGE, b"\0")
            os.pwrite(mem_fd, data, slot)
            totals.trap_bytes += len(data)


def _execute(
    proc: Proc,
    memfile_path: Path,
    view_name: str,
    file_id: int,
    mnt_id: int | None,
    growth_room: int,
    created: list[Path],
    huge_pages: bool = False,
    consume_pages: bool = False,
) -> tuple[MemFile | None, dict[str, Any] | None, _Totals]:
    """Write the memory file and the new page map/pages for one process (to temp names)."""
    totals = _Totals(shared=proc.count(Kind.SHARED))
    slots, offsets = Slots(growth_room), {}
    for i, kind in enumerate(proc.kinds):
        if kind in NEW_SLOT:
            v = proc.vmas[i]
            offsets[i] = slots.place(v["start"], v["end"] - v["start"])
    if not offsets:
        for p in proc.pieces:
            if p.src is not None:
                totals.kept += p.end - p.start
                if p.vma is not None and proc.kinds[p.vma] is Kind.SHARED:
                    totals.delta += p.end - p.start
        return None, None, totals

    mem_fd = os.open(memfile_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    created.append(memfile_path)
    # consume_pages: the dumped pages are punched out of the image as they move, so
    # the rewrite never holds two copies of the data
    src_fd = os.open(proc.pages_path, (os.O_RDWR if consume_pages else os.O_RDONLY) | os.O_CLOEXEC)
    tmp_pages = proc.pages_path.with_name(proc.pages_path.name + ".rewrite")
    out_fd = os.open(tmp_pages, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    created.append(tmp_pages)
    try:
        if huge_pages:
            os.ftruncate(mem_fd, slots.cursor)  # sized first: dense regions are written through mappings
        # every byte of the new file is written once: dumped pages, and around them
        # the rebased areas' old data and the file areas' file bytes
        _fill_base(proc, offsets, mem_fd, totals)
        entries: list[dict[str, Any]] = []
        out_off = 0
        moves: list[list[int]] = []  # [src, dst, n]: CRIU cuts runs of pages at 1 MiB, joined again
        for p in proc.pieces:
            n = p.end - p.start
            if p.vma is not None and proc.kinds[p.vma] is Kind.TRAP:
                continue  # a handler's table: rewritten whole, its old pages dropped
            if p.src is not None and p.vma in offsets:
                slot = offsets[p.vma] + p.start - proc.vmas[p.vma]["start"]
                if moves and moves[-1][0] + moves[-1][2] == p.src and moves[-1][1] + moves[-1][2] == slot:
                    moves[-1][2] += n
                else:
                    moves.append([p.src, slot, n])
                continue
            if p.src is not None:
                copy_range(src_fd, p.src, out_fd, out_off, n)
                out_off += n
                totals.kept += n
                if p.vma is not None and proc.kinds[p.vma] is Kind.SHARED:
                    totals.delta += n
            append_entry(entries, p)
        for src, dst, n in moves:
            totals.zero += n - write_data(src_fd, src, mem_fd, dst, n, huge=huge_pages)
            totals.moved += n
            if consume_pages:
                punch_hole(src_fd, src, n)
        os.ftruncate(mem_fd, slots.cursor)
        seal(mem_fd)
        data = os.fstat(mem_fd).st_blocks * 512
    finally:
        os.close(mem_fd)
        os.close(src_fd)
        os.close(out_fd)

    for i, slot in offsets.items():
        v, kind = proc.vmas[i], proc.kinds[i]
        totals.converted += kind is Kind.CONVERT
        totals.rebased += kind is Kind.REBASE
        totals.file += kind is Kind.FILE
        v["flags"] = v["flags"] & ~MAP_ANONYMOUS
        v["status"] = VMA_AREA_REGULAR | VMA_FILE_PRIVATE
        v["shmid"] = file_id
        v["pgoff"] = slot
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
    memfile = MemFile(memfile_path, proc.pid, len(offsets), data, slots.cursor)
    return memfile, {"type": "REG", "id": file_id, "reg": reg}, totals


def rewrite_images(
    images_dir: Path,
    memfile_dir: Path,
    *,
    convert_heap: bool = False,
    zero_fill: ZeroFillPolicy = ZeroFillPolicy.TRAP,
    trap_cache: Path | None = None,
    rebase_ratio: float | None = 0.5,
    growth_room: int = DEFAULT_GROWTH_ROOM,
    memfile_view: str | None = None,
    root: Path = Path("/"),
    tag: str | None = None,
    split_chunks: bool = True,
    file_maps: bool = True,
    huge_pages: bool = False,
    consume_pages: bool = False,
) -> RewriteResult:
    """Move the dump's private memory into memory files (see the package doc).

    ``memfile_dir``: a tmpfs directory for the new files. ``memfile_view``: that
    directory's path as the restored tasks see it (default: the same path).
    ``rebase_ratio``: rebase a process's areas of one memory file when their delta
    reaches this fraction of the data they map from it (None: never). ``root``:
    where the tasks' file names resolve (to read written file mappings' files and
    look for risky allocators). ``tag``: prefix of the new files' names (default:
    random). ``split_chunks``: give each glibc mmapped chunk its own slot.
    ``file_maps``: convert written private file mappings too. ``huge_pages``:
    ``memfile_dir`` is on a ``huge=advise`` tmpfs; give the dense 2 MiB regions of
    each file huge pages (``fileio.write_data``). ``consume_pages``:
    punch the dumped pages out of the images as they move into memory files (one
    copy of the data at a time instead of two; a failure after the first write
    leaves a dump to throw away). Otherwise, on failure the
    images are left unchanged and no new file is left behind.
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
    files_img = load(images_dir / "files.img")
    files = regular_files(files_img["entries"])
    next_id = max((e["id"] for e in files_img["entries"]), default=0) + 1

    trapping = zero_fill in (ZeroFillPolicy.TRAP, ZeroFillPolicy.REFUSE)
    blob = build_blob(trap_cache or memfile_dir.parent / "sigsys") if trapping else None
    risks = zero_fill_risks(images_dir, root=root) if zero_fill is ZeroFillPolicy.COPY else {}
    seccomp_img = trap.load_seccomp(images_dir) if trapping else None
    threads = {e["pid"]: list(e.get("threads") or [e["pid"]]) for e in load(images_dir / "pstree.img")["entries"]}
    left = dict(risks)

    created: list[Path] = []
    renames: list[tuple[Path, Path]] = []
    memfiles: list[MemFile] = []
    totals = _Totals()
    trapped = 0

    def stage(img: dict[str, Any], path: Path) -> None:
        tmp = path.with_name(path.name + ".rewrite")
        created.append(tmp)
        save(img, tmp)
        renames.append((tmp, path))

    try:
        with FileSources(images_dir, files, Path(root)) as sources:
            for pid in pids(images_dir):

                def planned(convert: bool, pid: int = pid) -> Proc | None:
                    return plan(
                        images_dir,
                        pid,
                        files,
                        convert_heap=convert_heap,
                        rebase_ratio=rebase_ratio,
                        memfile_dir=memfile_dir,
                        view=view,
                        split_chunks=split_chunks,
                        convert_anon=convert and pid not in risks,
                        sources=sources if file_maps and convert else None,
                    )

                proc = planned(True)
                if proc is None:
                    continue
                setup = None
                if blob is not None and proc.count(Kind.CONVERT, Kind.FILE):
                    cores = {t: load(images_dir / f"core-{t}.img")["entries"][0] for t in threads[pid]}
                    core = cores.get(pid) or load(images_dir / f"core-{pid}.img")["entries"][0]
                    try:
                        setup = trap.prepare(proc, blob, core, files, view, Path(root), cores)
                    except trap.TrapUnavailable as exc:
                        if zero_fill is ZeroFillPolicy.REFUSE:
                            raise NotForkable(
                                f"process {pid} ({dumped_command(images_dir, pid)}) of the dump cannot be given "
                                f"the trap that keeps converted memory exact: {exc}",
                                hint="fork it with zero_fill=TRAP (its memory is then copied, not shared) "
                                "or by copy (--mode copy)",
                                pid=pid,
                            ) from None
                        left[pid] = f"cannot get the SIGSYS handler ({exc}): its memory is copied"
                        proc = planned(False)
                        if proc is None:
                            continue
                    else:
                        proc.trap = setup.contents
                name = f"{tag}-{pid}{SUFFIX}"
                exe = files.get(proc.mm_img["entries"][0].get("exe_file_id", 0), {})
                mnt_id = exe["reg"]["mnt_id"] if "mnt_id" in exe.get("reg", {}) else None
                memfile, entry, stats = _execute(
                    proc,
                    memfile_dir / name,
                    f"{view.rstrip('/')}/{name}",
                    next_id,
                    mnt_id,
                    growth_room,
                    created,
                    huge_pages,
                    consume_pages,
                )
                totals.add(stats)
                if memfile is None or entry is None:
                    continue
                memfiles.append(memfile)
                files_img["entries"].append(entry)
                next_id += 1
                stage(proc.mm_img, images_dir / f"mm-{pid}.img")
                stage(proc.pm_img, images_dir / f"pagemap-{pid}.img")
                renames.append(
                    (proc.pages_path.with_name(proc.pages_path.name + ".rewrite"), proc.pages_path)
                )
                if setup is not None and blob is not None and seccomp_img is not None:
                    for img, path in trap.install(images_dir, pid, threads[pid], blob, setup, seccomp_img):
                        stage(img, path)
                    trapped += 1
        if trapped and seccomp_img is not None:
            stage(seccomp_img, images_dir / "seccomp.img")
        if memfiles:
            tmp = images_dir / "files.img.rewrite"
            created.append(tmp)
            save(files_img, tmp)
            renames.append((tmp, images_dir / "files.img"))
    except BaseException:
        for path in created:
            remove_memfile(path)
        raise
    for tmp, path in renames:
        os.replace(tmp, path)
    return RewriteResult(
        files=tuple(memfiles),
        vmas_converted=totals.converted,
        vmas_rebased=totals.rebased,
        vmas_shared=totals.shared,
        bytes_moved=totals.moved,
        delta_bytes=totals.delta,
        image_bytes=totals.kept,
        left_anonymous=tuple(Unconverted(pid, r) for pid, r in sorted(left.items())),
        duration_ms=(time.monotonic() - t0) * 1000,
        vmas_file=totals.file,
        zero_bytes=totals.zero,
        file_bytes=totals.file_bytes,
        trap_bytes=totals.trap_bytes,
        processes_trapped=trapped,
    )


def rebase(images_dir: Path, memfile_dir: Path, **kwargs: Any) -> RewriteResult:
    """``rewrite_images`` that rebases every memory-file area holding a delta."""
    kwargs["rebase_ratio"] = 0.0
    return rewrite_images(images_dir, memfile_dir, **kwargs)
