"""bunshin's tmpfs: mounted on first use (huge pages on request, images always), released when idle,
never over files; dense memory-file regions made huge pages."""

from __future__ import annotations

import mmap
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import RuntimeFailure
from bunshin.runtime.container import statefs
from bunshin.runtime.kernel import mountinfo
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
    statefs.ensure(home)
    images = statefs.images_root(home)
    assert statefs.ADVISE in statefs.options(home.tmpfs) and statefs.WITHIN_SIZE in statefs.options(images)
    assert statefs.huge_memfiles(home)
    # only what asks for huge pages gets them: files keep the usual 4 KiB I/O size
    (home.tmpfs / "f").write_bytes(b"x" * (4 << 20))
    assert os.stat(home.tmpfs / "f").st_blksize == 4096
    (home.tmpfs / "f").unlink()
    statefs.ensure(home)  # idempotent: no second mount on top
    targets = mountinfo.mount_points()
    assert targets.count(str(home.tmpfs)) == 1 and targets.count(str(images)) == 1
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
    statefs.ensure(home)
    assert not os.path.ismount(home.tmpfs) and (home.tmpfs / "someone's file").read_text() == "x"
    assert not statefs.huge_memfiles(home)
    assert statefs.release(home) is False  # not a mount: nothing to release


def test_dense_regions_of_a_memory_file_become_huge_pages(home):
    """Copied with huge=True, a region at least half data becomes one huge page (clones map it with a
    PMD); a sparse one keeps its holes."""
    statefs.ensure(home)
    page, huge = 4096, 2 << 20
    size = 4 * huge
    src = os.memfd_create("dump")
    path = home.tmpfs / "memfile"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(src, b"\x01" * huge, 0)  # region 0: all data
        os.pwrite(src, b"\x02" * page, huge + 5 * page)  # region 1: one page
        os.pwrite(src, b"\x03" * (huge // 2 + page), 3 * huge)  # region 3: just over half
        os.ftruncate(src, size)
        os.ftruncate(fd, size)
        fileio.write_data(src, 0, fd, 0, size, huge=True)
        assert os.pread(fd, size, 0) == os.pread(src, size, 0)
        # regions 0 and 3 whole (their zero pages included), region 1 its single page
        assert os.fstat(fd).st_blocks * 512 == 2 * huge + page
        assert list(fileio.data_extents(fd, huge, 3 * huge)) == [(huge + 5 * page, page)]
        with mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            assert sum(m[i] for i in range(0, size, page)) > 0  # fault every page in
            rollup = Path("/proc/self/smaps_rollup").read_text()
        pmd = int(next(ln for ln in rollup.splitlines() if ln.startswith("ShmemPmdMapped:")).split()[1])
        assert pmd >= 2 * (huge >> 10)  # KiB: both huge regions mapped 2 MiB at a time
    finally:
        os.close(src)
        os.close(fd)
        path.unlink()


def test_huge_copy_off_region_bounds_and_short_source(home):
    """huge=True with a destination offset inside a region and a source that ends inside the
    last one: the whole regions in between become huge pages, the partial ones are written page
    by page (zero pages left as holes), the bytes past the source's end read as zeros, and a
    source shorter than asked for (no src_end) is an error."""
    statefs.ensure(home)
    page, huge = 4096, 2 << 20
    data = bytearray(random.Random(5).randbytes(3 * huge))
    data[5 * page : 7 * page] = bytes(2 * page)  # zero pages in the unaligned head
    src = os.memfd_create("dump")
    path = home.tmpfs / "memfile"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(src, bytes(data), 0)
        dst_off, n, src_end = huge - 16 * page, 3 * huge, 3 * huge - 3 * page
        os.ftruncate(fd, 5 * huge)
        written = fileio.write_data(src, 0, fd, dst_off, n, src_end=src_end, huge=True)
        assert written == src_end - 2 * page
        expect = bytes(dst_off) + bytes(data[:src_end])
        assert os.pread(fd, 5 * huge, 0) == expect + bytes(5 * huge - len(expect))
        extents = list(fileio.data_extents(fd, 0, 5 * huge))
        assert extents[0] == (dst_off, 5 * page) and extents[1][0] == dst_off + 7 * page
        with mmap.mmap(fd, 5 * huge, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            assert sum(m[i] for i in range(0, 5 * huge, page)) > 0
            rollup = Path("/proc/self/smaps_rollup").read_text()
        pmd = int(next(ln for ln in rollup.splitlines() if ln.startswith("ShmemPmdMapped:")).split()[1])
        assert pmd >= 2 * (huge >> 10)  # regions 1 and 2 (whole, dense): 2 MiB each
        fresh = os.open(home.tmpfs / "memfile2", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fresh, 5 * huge)
            with pytest.raises(RuntimeFailure, match="ended early"):
                fileio.write_data(src, 0, fresh, 0, 4 * huge, huge=True)
        finally:
            os.close(fresh)
    finally:
        os.close(src)
        os.close(fd)
        path.unlink()
        (home.tmpfs / "memfile2").unlink(missing_ok=True)


def test_views_left_in_a_folder_that_is_no_longer_a_mount_are_released(home):
    """Views of an earlier tmpfs left in its folder (the tmpfs itself gone) are bunshin's
    state all the same: the idle release unmounts them."""
    from bunshin.runtime.container import idmap

    home.tmpfs.mkdir(parents=True)
    try:
        target = idmap.view(home, Path("/"))
        assert statefs.options(home.tmpfs) is None and str(target) in idmap.mounted(home)
        assert statefs.release(home) is True
        assert idmap.mounted(home) == set()
    finally:
        idmap.release(home)
