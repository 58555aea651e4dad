"""bunshin's tmpfs: mounted on first use with huge pages, released when idle, never over files."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bunshin.config import Config
from bunshin.runtime import statefs
from bunshin.runtime.memfile import fileio
from tests.conftest import drop_state_tmpfs

pytestmark = pytest.mark.integration


@pytest.fixture
def home(tmp_path) -> Iterator[Config]:
    cfg = Config.for_home(tmp_path / "home")
    drop_state_tmpfs(cfg)
    yield cfg
    drop_state_tmpfs(cfg)


def test_mounted_on_first_use_with_huge_pages_and_released_when_idle(home):
    assert statefs.ensure(home) is True
    assert os.path.ismount(home.tmpfs) and statefs.HUGE in statefs.options(home.tmpfs)
    assert statefs.ensure(home) is True  # idempotent: no second mount on top
    with open("/proc/self/mountinfo") as f:
        assert sum(line.split()[4] == str(home.tmpfs) for line in f) == 1
    (home.tmpfs / "layers" / "agent-x").mkdir(parents=True)  # caches do not hold it
    assert statefs.release(home) is True
    assert not home.tmpfs.exists()


def test_not_released_while_a_workspace_or_snapshot_is_in_it(home):
    statefs.ensure(home)
    for held in ("workspaces/ws-1", "snapshots/snap-1"):
        (home.tmpfs / held).mkdir(parents=True)
        assert statefs.release(home) is False and os.path.ismount(home.tmpfs)
        (home.tmpfs / held).rmdir()
    assert statefs.release(home) is True


def test_never_mounted_over_existing_files(home):
    home.tmpfs.mkdir(parents=True)
    (home.tmpfs / "someone's file").write_text("x")
    assert statefs.ensure(home) is False
    assert not os.path.ismount(home.tmpfs) and (home.tmpfs / "someone's file").read_text() == "x"
    assert statefs.release(home) is False  # not a mount: nothing to release


def test_dense_regions_of_a_memory_file_become_huge_pages(home):
    """Copied in file order, a dense 2 MiB region is one huge page; a sparse one keeps holes."""
    assert statefs.ensure(home)
    page, huge = 4096, 2 << 20
    src = os.memfd_create("src")
    dst_path = home.tmpfs / "memfile"
    dst = os.open(dst_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(src, b"\x01" * huge, 0)  # region 0: all data
        os.pwrite(src, b"\x02" * page, huge + 5 * page)  # region 1: one page
        os.pwrite(src, b"\x03" * (huge // 2 + page), 3 * huge)  # region 3: just over half
        size = 4 * huge
        os.ftruncate(src, size)
        expected = os.pread(src, size, 0)
        assert fileio.copy_in_huge_regions(src, dst, size) == 2
        os.ftruncate(dst, size)
        assert os.pread(dst, 4 * huge, 0) == expected
        assert not list(fileio.data_extents(src, 0, size))  # the staging file was emptied as it went
        # regions 0 and 3 whole (huge pages, zeros included); region 1 its page in a small
        # folio (the kernel may round it up to a few pages that fit the file size then)
        sparse = sum(n for _, n in fileio.data_extents(dst, huge, 3 * huge))
        assert page <= sparse <= 16 * page
        assert os.fstat(dst).st_blocks * 512 == 2 * huge + sparse
    finally:
        os.close(src)
        os.close(dst)
        dst_path.unlink()
