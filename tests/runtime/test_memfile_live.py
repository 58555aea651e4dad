"""Live conversion (memfile.live) on a real running process: pre-copy while it writes, a short stop, exact bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bunshin.runtime import memfile
from bunshin.runtime.memfile import live, remove_memfile, trapcode
from bunshin.runtime.memfile.live import LiveUnavailable, convert_live, live_areas

from .procs import kill_and_wait
from .test_memfile import (  # noqa: F401  (fixtures)
    OWN_CHECKS,
    SEM_CHECKS,
    _filter_chain,
    _semantics,
    _smaps,
    _want,
    criu_bin,
    lab,
    memprog,
    reaper,
    semprog,
    trap_cache,
)

MIB = 1 << 20

# An area of its own (guard pages either side) half filled with random bytes, the
# rest never touched; a thread keeps writing into it (mostly a hot 4 MiB, sometimes
# anywhere, holes too) and into a shadow copy elsewhere. "stop" ends the writer;
# each line is answered with the area's hash and whether it equals the shadow.
PROG = r"""
import ctypes, hashlib, random, sys, threading, time
N = int(sys.argv[1])
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, N + 8192, 3, 0x22, -1, 0) + 4096
libc.mprotect(ctypes.c_void_p(addr - 4096), 4096, 1)
libc.mprotect(ctypes.c_void_p(addr + N), 4096, 1)
mv = memoryview((ctypes.c_char * N).from_address(addr)).cast("B")
with open("/dev/urandom", "rb") as f:
    f.readinto(mv[: N // 2])
shadow = bytearray(mv)
stop = False
def writer():
    rnd, i = random.Random(3), 0
    while not stop:
        at = rnd.randrange(4 << 20) if i % 10 else rnd.randrange(N)
        mv[at] = shadow[at] = i & 255
        i += 1
        if i % 100 == 0:
            time.sleep(0.001)
t = threading.Thread(target=writer, daemon=True)
t.start()
time.sleep(0.2)
print(hex(addr), flush=True)
for line in sys.stdin:
    if line.strip() == "stop":
        stop = True
        t.join()
    elif line.startswith("w "):
        mv[int(line.split()[1])] ^= 0xFF
        shadow[int(line.split()[1])] ^= 0xFF
    print(hashlib.sha256(mv).hexdigest(), mv == shadow, flush=True)
"""


class Prog:
    def __init__(self, size: int) -> None:
        self.size = size
        self.p = subprocess.Popen([sys.executable, "-c", PROG, str(size)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.addr = int(self.p.stdout.readline(), 16)

    def ask(self, line: str) -> tuple[str, bool]:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        digest, same = self.p.stdout.readline().split()
        return digest, same == "True"

    def anon_kib(self) -> int:
        lines = Path(f"/proc/{self.p.pid}/smaps").read_text().splitlines()
        i = next(i for i, ln in enumerate(lines) if ln.startswith(f"{self.addr:x}-"))
        return int(next(ln for ln in lines[i + 1:] if ln.startswith("Anonymous:")).split()[1])

    def close(self) -> None:
        kill_and_wait(self.p.pid)
        self.p.stdin.close()
        self.p.stdout.close()


@pytest.fixture
def prog(request):
    p = Prog(getattr(request, "param", 64 * MIB))
    yield p
    p.close()


@pytest.fixture
def memfile_path(tmp_path: Path):
    path = tmp_path / "live.mem"
    yield path
    remove_memfile(path)


@pytest.mark.integration
@pytest.mark.parametrize("chunk", [live.CHUNK, 8 * MIB], ids=["one-piece", "eight-pieces"])
def test_converted_while_it_writes(prog: Prog, memfile_path: Path, chunk: int, monkeypatch) -> None:
    """(eight pieces: stopped eight times, the writer running between them on memory half converted)"""
    monkeypatch.setattr(live, "CHUNK", chunk)
    assert prog.anon_kib() > 30 * 1024
    res = convert_live(prog.p.pid, [(prog.addr, prog.addr + prog.size)], memfile_path, str(memfile_path))
    assert res.stops == -(-prog.size // chunk) and not res.left
    assert res.precopy_bytes >= 32 * MIB  # the random half, copied while it ran
    assert res.rounds and res.rounds[0] > 0  # the writer kept writing meanwhile: a second round copied that
    assert res.dirty_bytes < 16 * MIB  # while stopped: only what it wrote during the last round
    assert res.stopped_ms >= res.dirty_ms + res.remap_ms and res.pause_ms <= res.stopped_ms
    mapped = [ln.split()[0].split("-") for ln in Path(f"/proc/{prog.p.pid}/maps").read_text().splitlines()
              if ln.endswith(str(memfile_path)) and " rw-p " in ln]  # (pieces a write made anonymous stay apart)
    assert sum(int(b, 16) - int(a, 16) for a, b in mapped) == prog.size
    assert min(int(a, 16) for a, _ in mapped) == prog.addr
    assert prog.anon_kib() < 8 * 1024  # its anonymous copy is gone: the file holds the bytes
    digest, same = prog.ask("stop")
    assert same  # every byte it wrote before, during and after the conversion is there
    assert prog.ask(f"w {prog.size - 5}") == (prog.ask("h")[0], True)  # and it writes on (copy-on-write)
    assert memfile_path.stat().st_mode & 0o777 == 0o444
    def head() -> bytes:
        with memfile_path.open("rb") as f:
            f.seek(res.areas[0].offset)
            return f.read(8 * MIB)
    before = head()
    prog.ask("w 7")
    assert head() == before  # its writes stay private, never in the file


@pytest.mark.integration
def test_refusals_leave_the_process_as_it_was(prog: Prog, memfile_path: Path, tmp_path: Path) -> None:
    with pytest.raises(LiveUnavailable, match="not one private anonymous area"):
        convert_live(prog.p.pid, [(prog.addr, prog.addr + prog.size // 2)], memfile_path, str(memfile_path))
    assert not memfile_path.exists()
    planted = tmp_path / "planted.mem"
    planted.write_bytes(b"\0" * prog.size * 2)  # what the path leads to is not the host's file
    with pytest.raises(LiveUnavailable, match="is not the memory file"):
        convert_live(prog.p.pid, [(prog.addr, prog.addr + prog.size)], memfile_path, str(planted))
    assert not memfile_path.exists()
    maps = Path(f"/proc/{prog.p.pid}/maps").read_text()
    assert "planted" not in maps and "live.mem" not in maps
    assert not any("userfaultfd" in p.resolve().name for p in Path(f"/proc/{prog.p.pid}/fd").iterdir())
    assert "uw" not in Path(f"/proc/{prog.p.pid}/smaps").read_text().split(f"{prog.addr:x}-", 1)[1].split("VmFlags:")[1].split("\n")[0]
    assert prog.ask("stop")[1]  # its memory untouched, still anonymous
    assert prog.anon_kib() > 30 * 1024
    with pytest.raises(LiveUnavailable, match="gone"):
        convert_live(2**22 + 99, [], memfile_path, str(memfile_path))


# ------------------------------------------------- with the trap: semprog, then CRIU


@pytest.mark.criu
@pytest.mark.parametrize("variant", ["plain", "own", "noquery"], ids=["plain", "own-sigsys-handler", "no-procmap-query"])
def test_a_live_converted_process_keeps_linux_semantics(lab, semprog, trap_cache: Path, variant: str) -> None:  # noqa: F811
    """semprog converted live with the trap: DONTNEED, mremap, FREE, WIPEONFORK, masks, its own
    SIGSYS handler as before; then dumped and restored: the dump finds memory file and trap as in
    a clone's, and the clone keeps them."""
    prog, data = semprog
    checks = {**SEM_CHECKS, **(OWN_CHECKS if variant == "own" else {})}
    pid = lab.start([str(prog), str(lab.ctl), str(data), *([variant] if variant != "plain" else [])])
    areas = live_areas(pid)
    assert areas
    anon_before = _smaps(pid, "Anonymous")
    path = lab.mem / f"live-{pid}{memfile.SUFFIX}"
    res = convert_live(pid, areas, path, str(path), trap=trapcode.build_blob(trap_cache))
    assert res.pause_ms < 5000
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert maps.count(str(path)) >= len(areas) + 3  # every area, and the handler's code, table and state
    assert _smaps(pid, "Anonymous") < anon_before // 2
    assert _semantics(lab, pid, checks) == _want(checks)
    images = lab.dump(pid)
    rewritten = lab.rewrite(images)
    assert rewritten.left_anonymous == ()
    chain = [trapcode.is_ours(f) for f in _filter_chain(images, 1)]
    if variant == "plain":
        assert chain == [True]  # the live one, replaced
    else:
        # CRIU's image lists a filter added live below the program's own (seen here), so
        # the rewrite adds ours on top and the live one stays: both trap to the one handler
        assert chain.count(True) == 2 and chain[0]
    clone = lab.restore(images)
    assert _semantics(lab, clone, checks) == _want(checks)
    handlers = [ln for ln in Path(f"/proc/{clone}/maps").read_text().splitlines()
                if " r-xp " in ln and memfile.SUFFIX in ln]
    assert len(handlers) == 1, handlers


@pytest.mark.criu
def test_without_the_trap_dontneed_brings_back_old_bytes(lab, semprog) -> None:  # noqa: F811
    """Why the trap is needed (and what the semantics test above would catch without it)."""
    prog, data = semprog
    pid = lab.start([str(prog), str(lab.ctl), str(data)])
    path = lab.mem / f"bare-{pid}{memfile.SUFFIX}"
    convert_live(pid, live_areas(pid), path, str(path))
    assert lab.cmd(pid, "dontneed") != SEM_CHECKS["dontneed"]
