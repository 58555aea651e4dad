"""``memfile.vmcopy``: a live process's pages straight into a shared mapping of a file (a real child process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

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
    b = vmcopy._batches(runs, 1 << 30)
    assert [len(x) for x in b] == [vmcopy.IOV_MAX, 5] and sum(b, []) == runs
    big = vmcopy._batches([(0, 3 * vmcopy.BUFFER + PAGE)], vmcopy.BUFFER)
    assert [sum(hi - lo for lo, hi in x) for x in big] == [vmcopy.BUFFER] * 3 + [PAGE]
    assert vmcopy._batches([], vmcopy.BUFFER) == []


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


def test_a_run_the_process_does_not_map_is_an_error(child) -> None:
    p, _ = child
    low = 0x10000  # (below mmap_min_addr: never mapped)
    with tempfile.TemporaryFile(dir="/dev/shm") as f, pytest.raises(OSError, match="memory changed|Bad address"):
        vmcopy.copy_runs_buffered(p.pid, f.fileno(), -low, [(low, low + (8 << 20))], check_alive=lambda: None)


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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_copying_threads_run_boosted_and_get_their_own_nice_back(child, threads: int, monkeypatch) -> None:
    p, addr = child
    monkeypatch.setattr(vmcopy, "BUFFER", 1 << 20)
    seen = []

    def alive() -> None:  # (called in the copying thread)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        vmcopy.copy_runs_buffered(p.pid, f.fileno(), -addr, [(addr, addr + (4 << 20))], check_alive=alive,
                                  threads=threads)
    assert len(seen) == 4 and set(seen) == {min(own, vmcopy.NICE)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
