"""Rebase: folding a fork-of-a-fork's delta into a fresh memory file.

A clone's memory is already file-backed, so its dump holds only the pages it
wrote (a delta), restored privately into each of its own clones. When a delta
grows beyond ``ratio`` times the data its areas map from their memory file, the
areas get slots in a fresh file holding the old file's data with the delta on
top, and the delta leaves the image.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .fileio import data_extents, write_data


def _data_sizes(fd: int, vma: dict[str, Any]) -> Iterator[int]:
    """The sizes of the data extents ``vma`` maps from ``fd``, in order (walked as they are asked)."""
    off = vma["pgoff"]
    for _, n in data_extents(fd, off, off + vma["end"] - vma["start"]):
        yield n


def choose_rebase(
    vmas: list[dict[str, Any]],
    by_file: dict[int, list[int]],
    base_paths: dict[int, Path],
    stored: dict[int, int],
    ratio: float,
) -> list[int]:
    """The memory-file areas to rebase: per file, all of them or none (those whose
    delta reaches ``ratio`` times the data they map from the file).

    ``by_file``: memory file id -> indices of the areas mapping it (all their
    pages in this image or the file); ``stored``: delta bytes per area. The
    file's data is walked only until the answer is known (a small delta over a
    large file, as a first fork's after a live pre-copy, looks at its first
    extents only).
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
        base = 0
        try:
            for n in (n for i in idxs for n in _data_sizes(fd, vmas[i])):
                base += n
                if delta < ratio * base:
                    break  # more data than the delta reaches: the areas stay as they are
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
