"""The memory-semantics policy, and which dumped processes rely on ``MADV_DONTNEED`` zero-fill.

The heuristic serves ``ZeroFillPolicy.COPY`` only (with the default ``TRAP`` converted
memory is exact). Without the trap a converted area brings back the memory file's
bytes after ``MADV_DONTNEED``, not zeros. glibc's malloc never depends on it; jemalloc does (a purged extent is
marked zeroed and a later ``calloc`` skips the memset), and mimalloc may. A
process is at risk if it maps ``libjemalloc``/``libmimalloc`` or if its
executable or an executable mapping contains jemalloc's message prefix (static
linking, as Redis and many Rust programs do). Code that purges memory itself and
expects zeros (some JIT or wasm runtimes) is not detected.
"""

from __future__ import annotations

import enum
import os
import re
import threading
from pathlib import Path
from typing import Any

from bunshin.errors import InvalidArgument

from .criu_images import (
    PROT_EXEC,
    VMA_FILE_PRIVATE,
    VMA_FILE_SHARED,
    is_memfile_name,
    load,
    pids,
    regular_files,
)
from .fileio import open_in_root

_RISKY_LIBS = re.compile(r"/lib(jemalloc|mimalloc)[^/]*\.so")
_JEMALLOC_MARK = b"<jemalloc>"
_SCAN_LIMIT = 1 << 30  # larger files are not scanned
_CHUNK = 4 << 20


class ZeroFillPolicy(enum.Enum):
    """How converted memory keeps anonymous memory's semantics (``MADV_DONTNEED`` zero-fill and the rest).

    ``TRAP`` (default): convert every process and give it the SIGSYS handler that
    makes the differing calls exact (``trap``); a process that cannot get it keeps
    its memory anonymous (copied, exact) and is listed in ``left_anonymous``.
    ``REFUSE``: the same, but such a process raises ``NotForkable``. ``COPY``: no
    trap; a process this module's heuristic finds relying on zero-fill keeps its
    anonymous memory (the others get the differences). ``CONVERT``: no trap, no
    heuristic (the caller vouches for the processes).
    """

    TRAP = "trap"
    REFUSE = "refuse"
    COPY = "copy"
    CONVERT = "convert"

    @classmethod
    def _missing_(cls, value: object) -> ZeroFillPolicy:
        raise InvalidArgument(
            f"unknown memory-semantics policy {value!r}",
            hint=f"use one of {', '.join(p.value for p in cls)} (Config.memory_semantics)",
        )


class _ScanCache:
    """Whether a file contains the marker, by (device, inode, size, mtime)."""

    def __init__(self, limit: int = 4096) -> None:
        self._seen: dict[tuple[int, int, int, int], bool] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def contains(self, fd: int, needle: bytes) -> bool:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._seen:
                return self._seen[key]
        found = _scan(fd, needle)
        with self._lock:
            if len(self._seen) >= self._limit:
                self._seen.clear()
            self._seen[key] = found
        return found


def _scan(fd: int, needle: bytes) -> bool:
    """Whether the file holds ``needle`` (read in chunks that overlap by its length)."""
    pos, tail = 0, b""
    while True:
        chunk = os.pread(fd, _CHUNK, pos)
        if not chunk:
            return False
        if needle in chunk or needle in tail + chunk[: len(needle) - 1]:
            return True
        pos += len(chunk)
        tail = chunk[-(len(needle) - 1) :]


_CACHE = _ScanCache()


def mapped_names(
    mm: dict[str, Any], files: dict[int, dict[str, Any]], *, exec_only: bool = False
) -> set[str]:
    """Names of the files a process maps (its executable included)."""
    ids = {mm.get("exe_file_id", 0)}
    for v in mm.get("vmas", []):
        if v["status"] & (VMA_FILE_PRIVATE | VMA_FILE_SHARED) and (
            not exec_only or v["prot"] & PROT_EXEC
        ):
            ids.add(v["shmid"])
    return {files[i]["reg"]["name"] for i in ids if i in files and "reg" in files[i]}


def zero_fill_reason(
    mm: dict[str, Any], files: dict[int, dict[str, Any]], root: Path
) -> str | None:
    """Why one process relies on zero-fill, or None."""
    for name in sorted(mapped_names(mm, files)):
        if _RISKY_LIBS.search(name):
            return f"maps {name} (its allocator expects MADV_DONTNEED to zero memory)"
    for name in sorted(mapped_names(mm, files, exec_only=True)):
        if is_memfile_name(name):  # code files only: never read a (huge, sparse) memory file
            continue
        fd = open_in_root(root, name)
        if fd is None:
            continue
        try:
            if os.fstat(fd).st_size <= _SCAN_LIMIT and _CACHE.contains(fd, _JEMALLOC_MARK):
                return f"{name} contains jemalloc (it expects MADV_DONTNEED to zero memory)"
        finally:
            os.close(fd)
    return None


def zero_fill_risks(images_dir: Path, *, root: Path = Path("/")) -> dict[int, str]:
    """Processes of a dump whose allocator relies on MADV_DONTNEED zero-fill, with the reason.

    ``root``: where the dumped tasks' file names resolve (the workspace's root).
    """
    images_dir = Path(images_dir)
    files = regular_files(load(images_dir / "files.img")["entries"])
    risks = {}
    for pid in pids(images_dir):
        mm_path = images_dir / f"mm-{pid}.img"
        if mm_path.exists():
            reason = zero_fill_reason(load(mm_path)["entries"][0], files, Path(root))
            if reason:
                risks[pid] = reason
    return risks
