"""``memfile.vmcopy``: a live process's pages straight into a shared mapping of a file (a real child process)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from bunshin.runtime.memfile import vmcopy

PAGE = 4096

# maps 6 MiB of known bytes, prints its address, waits
CHILD = r"""
import mmap, sys, ctypes
m = mmap.mmap(-1, 6 << 20)
for i in range(0, 6 << 20, 4096):
    m[i:i + 4096] = bytes([(i // 4096) % 251 + 1]) * 4096
print(hex(ctypes.addressof(ctypes.c_char.from_buffer(m))), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield p, int(p.stdout.readline(), 16)
    finally:
        p.kill()
        p.wait()


def test_batches_respect_the_call_limits() -> None:
    runs = [(i * 2 * PAGE, i * 2 * PAGE + PAGE) for i in range(vmcopy.IOV_MAX + 5)]
    b = vmcopy._batches(runs)
    assert [len(x) for x in b] == [vmcopy.IOV_MAX, 5] and sum(b, []) == runs
    big = vmcopy._batches([(0, 3 * vmcopy.BATCH + PAGE)])
    assert [sum(hi - lo for lo, hi in x) for x in big] == [vmcopy.BATCH] * 3 + [PAGE]
    assert vmcopy._batches([]) == []


@pytest.mark.parametrize("threads", [1, 2])
def test_copies_the_runs_exactly_and_leaves_the_rest_holes(child, threads: int) -> None:
    p, addr = child
    calls = []
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        offset = 2 << 20
        os.ftruncate(f.fileno(), offset + (6 << 20))
        runs = [(addr, addr + PAGE), (addr + 3 * PAGE, addr + (5 << 20))]
        n = vmcopy.copy_runs(p.pid, f.fileno(), addr, addr + (6 << 20), offset, runs,
                             check_alive=lambda: calls.append(1), threads=threads)
        assert n == PAGE + (5 << 20) - 3 * PAGE and calls == [1]
        data = os.pread(f.fileno(), 6 << 20, offset)
        for i in range(0, 6 << 20, PAGE):
            inside = i < PAGE or 3 * PAGE <= i < (5 << 20)
            want = bytes([(i // PAGE) % 251 + 1]) * PAGE if inside else bytes(PAGE)
            assert data[i:i + PAGE] == want, i
        assert os.lseek(f.fileno(), 0, os.SEEK_DATA) == offset  # nothing written before the slot


def test_a_run_the_process_does_not_map_is_an_error(child) -> None:
    p, _ = child
    low = 0x10000  # (below mmap_min_addr: never mapped)
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.ftruncate(f.fileno(), 16 << 20)
        with pytest.raises(OSError, match="memory changed|Bad address"):
            vmcopy.copy_runs(p.pid, f.fileno(), low, low + (8 << 20), 0, [(low, low + (8 << 20))],
                             check_alive=lambda: None)


def test_a_full_filesystem_is_an_error_not_a_sigbus(child, tmp_path) -> None:
    p, addr = child
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "h7-vmcopy", str(mnt)], check=True)
    try:
        fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 6 << 20)
            with pytest.raises(OSError, match="no room"):
                vmcopy.copy_runs(p.pid, fd, addr, addr + (6 << 20), 0, [(addr, addr + (6 << 20))],
                                 check_alive=lambda: None)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_the_alive_check_failing_is_raised(child) -> None:
    p, addr = child

    def gone() -> None:
        raise ProcessLookupError("gone")

    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.ftruncate(f.fileno(), 6 << 20)
        with pytest.raises(ProcessLookupError):
            vmcopy.copy_runs(p.pid, f.fileno(), addr, addr + (6 << 20), 0, [(addr, addr + PAGE)], check_alive=gone)
    p.send_signal(signal.SIGKILL)
    p.wait()
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.ftruncate(f.fileno(), 6 << 20)
        with pytest.raises(OSError, match="No such process"):
            vmcopy.copy_runs(p.pid, f.fileno(), addr, addr + (6 << 20), 0, [(addr, addr + PAGE)],
                             check_alive=lambda: None)


def test_dense_regions_are_whole_2_mib_regions_the_runs_fill_enough() -> None:
    mib = 1 << 20
    # region 0 full, region 1 at 3/4 (from a run crossing the boundary), region 2 at 1/4
    runs = [(0, 3 * mib + mib // 2), (4 * mib + 1 * mib, 4 * mib + 3 * mib // 2)]
    assert vmcopy.dense_regions(runs, 0) == {0, 1}
    assert vmcopy.dense_regions(runs, 2 * mib) == {1, 2}  # the same runs, one region on in the file
    assert vmcopy.dense_regions([], 0) == set()


def _pmd_mapped_kib(path) -> int:
    """ShmemPmdMapped of a fresh shared mapping of ``path`` once every page is read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            for i in range(0, len(m), PAGE):
                m[i]
            start = None
            for line in open("/proc/self/smaps").read().splitlines():
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and head[-1] == str(path):
                    start = True
                elif start and line.startswith("ShmemPmdMapped:"):
                    return int(line.split()[1])
            return 0
        finally:
            m.close()
    finally:
        os.close(fd)


def test_huge_puts_dense_regions_in_huge_pages_exactly(child, tmp_path) -> None:
    p, addr = child
    mnt = tmp_path / "huge"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,huge=advise", "h7-vmcopy", str(mnt)], check=True)
    try:
        fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 8 << 20)
            # the child's 6 MiB at file offset 0: region 0 and 1 whole, region 2 one page only
            runs = [(addr, addr + (4 << 20)), (addr + (4 << 20), addr + (4 << 20) + PAGE)]
            n = vmcopy.copy_runs(p.pid, fd, addr, addr + (6 << 20), 0, runs, check_alive=lambda: None, huge=True)
            assert n == (4 << 20) + PAGE
            data = os.pread(fd, 6 << 20, 0)
            for i in range(0, 6 << 20, PAGE):
                want = bytes([(i // PAGE) % 251 + 1]) * PAGE if i < (4 << 20) + PAGE else bytes(PAGE)
                assert data[i:i + PAGE] == want, i
            st = os.fstat(fd)
            assert (5 << 20) > st.st_blocks * 512 >= (4 << 20) + PAGE  # the sparse region kept its holes
        finally:
            os.close(fd)
        assert _pmd_mapped_kib(mnt / "f") >= 4096  # the two dense regions are huge pages
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_huge_on_a_full_filesystem_is_an_error_not_a_sigbus(child, tmp_path) -> None:
    p, addr = child
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,huge=advise", "h7-vmcopy", str(mnt)], check=True)
    try:
        fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 6 << 20)
            with pytest.raises(OSError, match="memory changed|Bad address|no room"):
                vmcopy.copy_runs(p.pid, fd, addr, addr + (6 << 20), 0, [(addr, addr + (6 << 20))],
                                 check_alive=lambda: None, huge=True)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ------------------------------------------------- the buffered copy (what memfile.live uses)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_buffered_copy_writes_the_runs_exactly_and_leaves_the_rest_holes(child, threads: int, monkeypatch) -> None:
    p, addr = child
    monkeypatch.setattr(vmcopy, "BUFFER", 1 << 20)  # several reads, runs cut across them
    calls = []
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        offset = 2 << 20
        os.ftruncate(f.fileno(), offset + (6 << 20))
        runs = [(addr, addr + PAGE), (addr + 3 * PAGE, addr + (5 << 20))]
        n = vmcopy.copy_runs_buffered(p.pid, f.fileno(), offset - addr, runs, check_alive=lambda: calls.append(1),
                                      threads=threads)
        assert n == PAGE + (5 << 20) - 3 * PAGE and len(calls) == len(vmcopy._batches(runs, 1 << 20)) == 5
        data = os.pread(f.fileno(), 6 << 20, offset)
        for i in range(0, 6 << 20, PAGE):
            inside = i < PAGE or 3 * PAGE <= i < (5 << 20)
            want = bytes([(i // PAGE) % 251 + 1]) * PAGE if inside else bytes(PAGE)
            assert data[i:i + PAGE] == want, i
        assert os.lseek(f.fileno(), 0, os.SEEK_DATA) == offset  # nothing written before the slot
        assert os.lseek(f.fileno(), offset + PAGE, os.SEEK_HOLE) == offset + PAGE  # the gap stays a hole


def test_a_read_whose_alive_check_fails_never_reaches_the_file(child) -> None:
    """The pid may be another process's by the check: what was read is not written."""
    p, addr = child

    def gone() -> None:
        raise ProcessLookupError("gone")

    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        os.ftruncate(f.fileno(), 6 << 20)
        with pytest.raises(ProcessLookupError):
            vmcopy.copy_runs_buffered(p.pid, f.fileno(), -addr, [(addr, addr + (6 << 20))], check_alive=gone)
        assert os.fstat(f.fileno()).st_blocks == 0  # not one byte written
    p.send_signal(signal.SIGKILL)
    p.wait()
    with tempfile.TemporaryFile(dir="/dev/shm") as f, pytest.raises(OSError, match="No such process"):
        vmcopy.copy_runs_buffered(p.pid, f.fileno(), -addr, [(addr, addr + PAGE)], check_alive=lambda: None)


def test_the_buffered_copy_on_a_full_filesystem_is_an_error(child, tmp_path) -> None:
    p, addr = child
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "h7-vmcopy-b", str(mnt)], check=True)
    try:
        fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError, match="No space"):
                vmcopy.copy_runs_buffered(p.pid, fd, -addr, [(addr, addr + (6 << 20))], check_alive=lambda: None)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
