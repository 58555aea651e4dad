"""Dirty private file mappings: which may become memory-file mappings, and their files.

A private file mapping a process wrote to (the ``.data`` and RELRO segments of
every shared library, mostly) holds two kinds of pages: pages never written map
the file's page cache, written ones are private copies, which CRIU dumps and
every plain restore copies again. Such an area becomes a private mapping of a
memory-file slot holding the area's current contents: the file's bytes for the
range with the dumped pages on top. The process sees the same bytes either way,
and a write still copies one page into the writer.

What is converted, conservatively: plain private mappings of a regular file
(no CRIU status bit but regular and file-private, flags within
MAP_PRIVATE|MAP_NORESERVE, not executable: a memory file may sit on a
``noexec`` tmpfs, and no ``MADV_WIPEONFORK``) with pages stored in the image.
Only the part of the area inside the file (up to the page holding its end):
beyond it an access raises SIGBUS, and still does. In a large area, clean runs
of ``CLEAN_GAP`` or more stay mapped to the original file, so a huge mapping
with a few written pages does not copy the whole file.

The file's bytes are read where the tasks saw the file: its name resolved under
the tasks' root, one component at a time and never through a symbolic link
(``open_in_root``), and only if the file lies on the root mount of the task's
mount namespace (a file on another mount, /tmp for instance, could not be told
apart from what lies beneath that mount), has the size CRIU recorded, and was
not deleted or replaced (no link-remap). Anything else stays as it is.

Differences, none of which a loader or a library's own code relies on: the
slot holds the bytes of the rewrite's moment, so a later write to the original
file no longer shows through pages never written (Linux shows it in a private
mapping, POSIX leaves it unspecified); ``MADV_DONTNEED`` brings back the
dump-time bytes rather than the file's; growing the area with ``mremap`` reads
the slot's hole (zeros) rather than more of the file; and ``/proc/PID/maps``
names the memory file for the converted part. The file must not change between
the dump and the rewrite: only its size is checked (CRIU checks no more for the
mappings it restores from the file itself).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .criu_images import (
    MADV_WIPEONFORK,
    MAP_NORESERVE,
    MAP_PRIVATE,
    PAGE,
    PROT_EXEC,
    VMA_AREA_REGULAR,
    VMA_FILE_PRIVATE,
    is_memfile_name,
    load,
)
from .fileio import open_in_root

CLEAN_GAP = 512 << 10
_ANY_MOUNT = -1


def convertible_file_map(vma: dict[str, Any]) -> bool:
    """A plain, non-executable private mapping of a regular file (whitelists)."""
    flags, status = vma["flags"], vma["status"]
    if status != VMA_AREA_REGULAR | VMA_FILE_PRIVATE:
        return False
    if not flags & MAP_PRIVATE or flags & ~(MAP_PRIVATE | MAP_NORESERVE):
        return False
    if vma["prot"] & PROT_EXEC:
        return False
    return not vma.get("madv", 0) & (1 << MADV_WIPEONFORK)


def file_ranges(
    start: int, end: int, in_file_end: int, dirty: list[tuple[int, int]], gap: int = CLEAN_GAP
) -> list[tuple[int, int, bool]]:
    """Cut [start, end) into ranges to convert (True) or to leave mapped to the file (False).

    ``dirty``: the sorted address ranges whose pages are in the image.
    ``in_file_end``: the address where the file ends (page-rounded). Dirty runs
    are joined across clean runs shorter than ``gap``, and reach the area's
    in-file ends when closer than ``gap`` to them.
    """
    limit = min(end, in_file_end)
    clusters: list[list[int]] = []
    for a, b in dirty:
        a, b = max(a, start), min(b, limit)
        if a >= b:
            continue
        if clusters and a - clusters[-1][1] < gap:
            clusters[-1][1] = max(clusters[-1][1], b)
        else:
            clusters.append([a, b])
    if not clusters:
        return [(start, end, False)]
    if clusters[0][0] - start < gap:
        clusters[0][0] = start
    if limit - clusters[-1][1] < gap:
        clusters[-1][1] = limit
    out: list[tuple[int, int, bool]] = []
    pos = start
    for a, b in clusters:
        if a > pos:
            out.append((pos, a, False))
        out.append((a, b, True))
        pos = b
    if pos < end:
        out.append((pos, end, False))
    return out


class FileSources:
    """The regular files a dump's private mappings map, opened where the tasks saw them.

    Use as a context manager: it keeps the files it opened open until closed.
    """

    def __init__(self, images_dir: Path, files: dict[int, dict[str, Any]], root: Path) -> None:
        self._images = Path(images_dir)
        self._files = files
        self._root = Path(root)
        self._opened: dict[int, tuple[int, int] | None] = {}  # file id -> (fd, size)
        self._root_mounts: dict[int, int | None] = {}  # pid -> mnt_id of its root mount
        self._remapped: set[int] | None = None

    def __enter__(self) -> FileSources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for entry in self._opened.values():
            if entry is not None:
                os.close(entry[0])
        self._opened.clear()

    def source(self, pid: int, file_id: int) -> tuple[int, int] | None:
        """(fd, size) of the file ``file_id`` as process ``pid`` maps it, or None if unusable."""
        reg = self._files.get(file_id, {}).get("reg")
        if reg is None or "size" not in reg or is_memfile_name(str(reg.get("name", ""))):
            return None
        mount = self._root_mount(pid)
        if mount is None or (mount != _ANY_MOUNT and reg.get("mnt_id", -2) != mount):
            return None
        if file_id in self._remapped_ids():
            return None
        if file_id not in self._opened:
            self._opened[file_id] = self._open(str(reg["name"]), reg["size"])
        return self._opened[file_id]

    def _open(self, name: str, size: int) -> tuple[int, int] | None:
        fd = open_in_root(self._root, name)
        if fd is None:
            return None
        if os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        return fd, size

    def _root_mount(self, pid: int) -> int | None:
        """The id of the mount the task's "/" is, ``_ANY_MOUNT``, or None (use no file)."""
        if pid not in self._root_mounts:
            self._root_mounts[pid] = self._find_root_mount(pid)
        return self._root_mounts[pid]

    def _find_root_mount(self, pid: int) -> int | None:
        try:
            ids = load(self._images / f"ids-{pid}.img")["entries"][0]
        except (OSError, IndexError, KeyError):
            return None
        mounts = self._images / f"mountpoints-{ids.get('mnt_ns_id', 0)}.img"
        if not mounts.exists():
            # the task shares CRIU's mount namespace: its names are this host's paths
            return _ANY_MOUNT if self._root.resolve() == Path("/") else None
        roots = [e for e in load(mounts)["entries"] if e.get("mountpoint") == "/"]
        return roots[0]["mnt_id"] if len(roots) == 1 else None

    def _remapped_ids(self) -> set[int]:
        """Files CRIU found deleted or replaced (their name no longer leads to them)."""
        if self._remapped is None:
            path = self._images / "remap-fpath.img"
            entries = load(path)["entries"] if path.exists() else []
            self._remapped = {e["orig_id"] for e in entries}
        return self._remapped


def in_file_end(vma: dict[str, Any], size: int) -> int:
    """The address where the mapped file ends, rounded up to a page."""
    return int(vma["start"] + -(-size // PAGE) * PAGE - vma["pgoff"])
