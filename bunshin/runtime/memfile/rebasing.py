"""Rebase: folding a fork-of-a-fork's delta into a fresh memory file.

A clone's memory is already file-backed, so its dump holds only the pages it
wrote (a delta), restored privately into each of its own clones. When a delta
grows beyond ``ratio`` times the data its areas map from their memory file, the
areas get slots in a fresh file holding the old file's data with the delta on
top, and the delta leaves the image.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .fileio import data_extents, write_data


def _mapped_data(fd: int, vma: dict[str, Any]) -> int:
    off = vma["pgoff"]
    end = off + vma["end"] - vma["start"]
    return sum(n for _, n in data_extents(fd, off, end))


def choose_rebase(
    vmas: list[dict[str, Any]],
    by_file: dict[int, list[int]],
    base_paths: dict[int, Path],
    stored: dict[int, int],
    ratio: float,
) -> list[int]:
    """The memory-file areas to rebase: per file, all of them or none.

    ``by_file``: memory file id -> indices of the areas mapping it (all their
    pages in this image or the file); ``stored``: delta bytes per area.
    """
    chosen: list[int] = []
    for shmid, idxs in by_file.items():
        delta = sum(stored.get(i, 0) for i in idxs)
        if delta == 0:
            continue
        try:
            fd = os.open(base_paths[shmid], os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # gone: nothing to fold the delta into
        try:
            base = sum(_mapped_data(fd, vmas[i]) for i in idxs)
        finally:
            os.close(fd)
        if delta >= ratio * base:
            chosen += idxs
    return chosen


def copy_base(
    base: Path, vma: dict[str, Any], gaps: list[tuple[int, int]], dst: int, slot: int
) -> int:
    """Copy an area's data from its old memory file into its new slot, in ``gaps`` only.

    ``gaps``: the address ranges the delta does not cover. Returns bytes written.
    """
    start, pgoff = vma["start"], vma["pgoff"]
    fd = os.open(base, os.O_RDONLY | os.O_CLOEXEC)
    written = 0
    try:
        size = os.fstat(fd).st_size
        for a, b in gaps:
            for off, n in data_extents(fd, pgoff + a - start, pgoff + b - start):
                written += write_data(fd, off, dst, slot + off - pgoff, n, src_end=size)
    finally:
        os.close(fd)
    return written
