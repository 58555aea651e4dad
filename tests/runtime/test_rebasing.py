"""``memfile.rebasing.choose_rebase``: a real sparse tmpfs file, decisions against the full count."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bunshin.runtime.memfile import rebasing
from bunshin.runtime.memfile.fileio import data_extents

PAGE = 4096
EXTENTS = 64  # one data page, then a hole page, 64 times, in each of two areas


@pytest.fixture
def sparse():
    """A tmpfs file of two areas' slots, each holding ``EXTENTS`` one-page extents."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        slot = 2 * EXTENTS * PAGE
        for k in range(2):
            for i in range(EXTENTS):
                os.pwrite(f.fileno(), b"\x01" * PAGE, k * slot + 2 * i * PAGE)
        vmas = [{"start": 0x10000000 + k * slot, "end": 0x10000000 + (k + 1) * slot, "pgoff": k * slot}
                for k in range(2)]
        yield Path(f.name), vmas


def _walked(monkeypatch) -> list[int]:
    walked: list[int] = []

    def counting(fd: int, start: int, end: int):
        for ext in data_extents(fd, start, end):
            walked.append(ext[1])
            yield ext

    monkeypatch.setattr(rebasing, "data_extents", counting)
    return walked


@pytest.mark.parametrize("delta_pages", [1, 31, 32, 63, 64, 65, 127, 128])
@pytest.mark.parametrize("ratio", [0.5, 1.0, 0.25])
def test_the_same_areas_are_chosen_as_by_the_whole_count(sparse, delta_pages: int, ratio: float) -> None:
    path, vmas = sparse
    base = 2 * EXTENTS * PAGE  # the data both areas map
    got = rebasing.choose_rebase(vmas, {7: [0, 1]}, {7: path}, {0: delta_pages * PAGE}, ratio)
    assert got == ([0, 1] if delta_pages * PAGE >= ratio * base else [])


def test_a_small_delta_over_a_large_file_stops_after_a_few_extents(sparse, monkeypatch) -> None:
    path, vmas = sparse
    walked = _walked(monkeypatch)
    # 2 pages of delta at ratio 0.5 are outweighed once 5 pages of data are seen
    assert rebasing.choose_rebase(vmas, {7: [0, 1]}, {7: path}, {1: 2 * PAGE}, 0.5) == []
    assert len(walked) == 5
    walked.clear()
    # a delta as large as all the data: every extent of both areas is counted
    assert rebasing.choose_rebase(vmas, {7: [0, 1]}, {7: path}, {1: 2 * EXTENTS * PAGE}, 0.5) == [0, 1]
    assert len(walked) == 2 * EXTENTS


def test_no_delta_or_a_missing_file_chooses_nothing(sparse, tmp_path: Path) -> None:
    path, vmas = sparse
    assert rebasing.choose_rebase(vmas, {7: [0, 1]}, {7: path}, {}, 0.5) == []
    assert rebasing.choose_rebase(vmas, {7: [0, 1]}, {7: tmp_path / "gone"}, {0: 1 << 30}, 0.5) == []
