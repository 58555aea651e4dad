"""Dirty-page tracking of a live process in a real workspace: exactly the written pages, torn down cleanly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bunshin.runtime.dirty import Tracker, TrackingUnavailable

from .test_inject import host_pid

PAGE = 4096
PAGES = 512

# An area of PAGES pages (the first 64 written before tracking starts); on SIGUSR1
# it applies /tmp/cmd: "w N..." writes one byte of each page N, "r N" reads a page
# of /dev/urandom into page N (a write by the kernel), "z N..." reads a byte of each, "m" moves the area (mremap),
# then answers in /tmp/done.
PROG = r"""
import ctypes, mmap, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
N = int(os.environ.get("PAGES", "512"))
addr = libc.mmap(None, N * 4096, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
if os.environ.get("NOHUGE"):
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(ctypes.c_void_p(addr), N * 4096, 15) == 0  # MADV_NOHUGEPAGE: one page a fault
ctypes.memset(addr, 7, 64 * 4096)
rnd = os.open("/dev/urandom", os.O_RDONLY)
seq = [0]
def apply(*_):
    global addr
    op, *args = open("/tmp/cmd").read().split()
    if op == "w":
        for n in map(int, args):
            ctypes.c_char.from_address(addr + int(n) * 4096 + 11).value = b"x"
    elif op == "z":  # read only: the page maps the shared zero page
        for n in map(int, args):
            ctypes.c_char.from_address(addr + int(n) * 4096 + 11).value
    elif op == "r":
        libc.read(rnd, ctypes.c_void_p(addr + int(args[0]) * 4096), 4096)
    elif op == "m":
        addr = libc.mremap(ctypes.c_void_p(addr), N * 4096, N * 4096, 3, ctypes.c_void_p(addr + (1 << 32)))
    seq[0] += 1
    open("/tmp/done.tmp", "w").write(str(seq[0])); os.replace("/tmp/done.tmp", "/tmp/done")
signal.signal(signal.SIGUSR1, apply)
open("/tmp/addr.tmp", "w").write(hex(addr)); os.replace("/tmp/addr.tmp", "/tmp/addr")
while True:
    signal.pause()
"""


class Prog:
    def __init__(self, family, *env: str) -> None:
        self.ws = family.create()
        pid = self.ws.commands.spawn(["env", f"PAGES={PAGES}", *env, "python3", "-c", PROG])
        self.pid = host_pid(self.ws, pid)
        self.addr = int(self._wait("/tmp/addr"), 16)
        self.seq = 0

    def _wait(self, path: str, want: str | None = None) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                text = self.ws.files.read_text(path)
                if text and (want is None or text == want):
                    return text
            except Exception:  # not written yet
                pass
            time.sleep(0.01)
        raise AssertionError(f"no {path}")

    def do(self, cmd: str) -> None:
        self.ws.files.write("/tmp/cmd", cmd)
        os.kill(self.pid, signal.SIGUSR1)
        self.seq += 1
        self._wait("/tmp/done", str(self.seq))

    def pages(self, runs) -> list[int]:
        return [n for r in runs for n in range((r.start - self.addr) // PAGE, (r.end - self.addr) // PAGE)]


def _vmflags(pid: int, addr: int) -> list[str]:
    lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{addr:x}-"):
            return next(ln for ln in lines[i + 1:] if ln.startswith("VmFlags:")).split()[1:]
    raise AssertionError(f"no area at {addr:#x}")


def test_exactly_the_written_pages(family) -> None:
    p = Prog(family)
    with Tracker.open(p.pid) as t:
        t.track(p.addr, p.addr + PAGES * PAGE)
        area = t.areas[0]
        assert "uw" in _vmflags(p.pid, p.addr)  # registered for write-protect
        assert t.written(area) == []  # nothing written since it was protected
        p.do("w 3 4 5 63 64 300 511")  # populated and never-touched pages alike
        assert p.pages(t.written(area)) == [3, 4, 5, 63, 64, 300, 511]
        assert t.written(area) == []  # protected again by the same walk
        p.do("r 200")  # the kernel writing into it (read(2)) counts too
        p.do("w 3")
        assert p.pages(t.written(area)) == [3, 200]
        p.do("w 9")
        assert p.pages(t.written(area, protect=False)) == [9]
        assert p.pages(t.written(area)) == [9]  # a look without protect leaves them written
    assert "uw" not in _vmflags(p.pid, p.addr)  # torn down: the area is as before
    assert not any("userfaultfd" in os.readlink(f"/proc/{p.pid}/fd/{f}") for f in os.listdir(f"/proc/{p.pid}/fd"))
    p.do("w 1 2")  # still running and writing, untracked


def test_a_moved_area_is_reported_untracked(family) -> None:
    p = Prog(family)
    with Tracker.open(p.pid) as t:
        t.track(p.addr, p.addr + PAGES * PAGE)
        p.do("m")
        assert t.written(t.areas[0]) is None  # gone from where it was registered: copy it whole
    p.do("w 0")


def test_refusals(family) -> None:
    p = Prog(family)
    with pytest.raises(TrackingUnavailable, match="gone"):
        Tracker.open(2**22 + 4321)
    text = next(ln for ln in Path(f"/proc/{p.pid}/maps").read_text().splitlines() if "[vvar]" in ln or "[vdso]" in ln)
    lo, hi = (int(x, 16) for x in text.split()[0].split("-"))
    with Tracker.open(p.pid) as t, pytest.raises(TrackingUnavailable, match="cannot be tracked"):
        t.track(lo, hi)  # not anonymous memory
    p.do("w 0")


def test_present_leaves_out_pages_only_read(family) -> None:
    """A page only read maps the shared zero page: not present (a pre-copy into the file would give it memory)."""
    p = Prog(family, "NOHUGE=1")
    with Tracker.open(p.pid) as t:
        t.track(p.addr, p.addr + PAGES * PAGE)
        p.do("z 100 101 102 400")
        p.do("w 300 101")
        everything = (p.addr, p.addr + PAGES * PAGE)
        assert p.pages(t.present(*everything)) == [*range(64), 101, 300]
        # the rest holds write-protect markers (never touched since tracked), which count as swapped
        assert p.pages(t.swapped(*everything)) == [n for n in range(64, PAGES) if n not in (100, 101, 102, 300, 400)]
