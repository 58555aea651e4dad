"""Copy-on-write forks: the image rewrite, checked on real dumps and restores.

The workload is tests/runtime/progs/memprog.c (compiled here with gcc), run
alone in its own pid namespace; every restore gets a fresh pid namespace, so
clones run side by side. For written private file mappings it loads
tests/runtime/progs/libblob.c, a library whose .data is a blob of known bytes.
Unit tests of the page-map arithmetic and file plumbing need no CRIU.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bunshin.config import Config
from bunshin.errors import InvalidArgument, NotForkable, RuntimeFailure
from bunshin.runtime import memfile
from bunshin.runtime.container import seccomp
from bunshin.runtime.criu import run as criu
from bunshin.runtime.memfile import (
    PAGE,
    ZeroFillPolicy,
    fileio,
    filemaps,
    plan,
    rewrite,
    sites,
    trap,
    trapcode,
)
from bunshin.runtime.memfile import criu_images as image_io

from .procs import PR_SET_CHILD_SUBREAPER, kill_and_wait, prctl

PROGS = Path(__file__).parent / "progs"
MIB = 1 << 20
CRIU = Config.from_env().criu
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


# ------------------------------------------------------------------ harness


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _smaps(pid: int, key: str) -> int:
    """A /proc/PID/smaps_rollup field, in bytes."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _read_mem(pid: int, addr: int, n: int) -> bytes:
    """What process ``pid`` reads at ``addr`` (OSError where it would fault)."""
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, n, addr)
    finally:
        os.close(fd)


def _mapping(pid: int, addr: int) -> tuple[int, int, str]:
    """(start, file offset, path) of the area of process ``pid`` holding ``addr``."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= addr < end:
            return start, int(fields[2], 16), fields[5] if len(fields) > 5 else ""
    raise KeyError(hex(addr))


def _system_used() -> int:
    """Memory in use system-wide, tmpfs included (bytes)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, value = line.split(":", 1)
        info[name] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def _digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.img"))
    }


class Lab:
    """Runs memprog in pid namespaces, dumps, rewrites, restores; cleans up everything."""

    def __init__(self, criu_bin: Path, memprog: Path, workdir: Path, trap_cache: Path) -> None:
        self.criu = criu_bin
        self.trap_cache = trap_cache
        self.memprog = memprog
        self.workdir = workdir
        self.ctl = workdir / "ctl"
        self.ctl.mkdir()
        self.mem = Path("/dev/shm") / f"bunshin-test-{uuid.uuid4().hex[:8]}"
        self.mem.mkdir()
        self.pids: list[int] = []
        self.popens: list[subprocess.Popen[bytes]] = []
        self.images: list[Path] = []
        self.restore_ms: list[float] = []

    def spawn(
        self,
        mib: int,
        threads: int = 2,
        children: int = 0,
        *,
        env: dict[str, str] | None = None,
        prog: Path | None = None,
    ) -> int:
        """Start memprog; wait until it and its children are ready."""
        args = [str(mib), str(threads), str(children)]
        return self.start([str(prog or self.memprog), str(self.ctl), *args], children, env=env)

    def start(
        self, argv: list[str], children: int = 0, *, env: dict[str, str] | None = None
    ) -> int:
        """Start a program alone in a new pid namespace; it writes CTL/<hostpid>.ready."""
        p = subprocess.Popen(
            ["unshare", "--pid", "--fork", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd=self.workdir,  # CRIU's parasite mounts its /proc at ./proc.crtools: a folder of this test's own
        )
        self.popens.append(p)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                kids = _children(p.pid) if p.poll() is None else []
            except OSError:
                kids = []
            if kids:
                pid = kids[0]
                if pid not in self.pids:
                    self.pids.append(pid)
                procs = [pid, *_children(pid)]
                if len(procs) == children + 1 and all(
                    (self.ctl / f"{q}.ready").exists() for q in procs
                ):
                    return pid
            elif p.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {p.returncode}")
            time.sleep(0.01)
        raise TimeoutError(f"{argv[0]} did not get ready")

    def cmd(self, pid: int, text: str, timeout: float = 120) -> dict[str, str]:
        out = self.ctl / f"{pid}.out"
        out.unlink(missing_ok=True)
        tmp = self.ctl / f"{pid}.cmd.tmp"
        tmp.write_text(text)
        tmp.rename(self.ctl / f"{pid}.cmd")
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if out.exists():
                return dict(kv.split("=", 1) for kv in out.read_text().split() if "=" in kv) or {
                    "ok": "1"
                }
            time.sleep(0.002)
        raise TimeoutError(f"{pid} did not answer {text!r}")

    def dump(self, pid: int) -> Path:
        images = self.workdir / f"img{len(self.images)}"
        self.images.append(images)
        criu.dump(self.criu, pid, images)
        return images

    def rewrite(self, images: Path, **kwargs: Any) -> memfile.RewriteResult:
        """``rewrite_images`` into this lab's memory-file folder."""
        return memfile.rewrite_images(images, self.mem, trap_cache=self.trap_cache, **kwargs)

    def restore(self, images: Path) -> int:
        run = criu.restore(self.criu, images, pidfile=self.workdir / f"clone{len(self.pids)}.pid")
        assert run.pid is not None
        self.pids.append(run.pid)
        self.restore_ms.append(run.duration_ms)
        return run.pid

    def close(self) -> None:
        for pid in reversed(self.pids):
            kill_and_wait(pid)
        for p in self.popens:
            p.kill()
            p.wait()
        _reap_all()
        memfile.remove_memfiles(self.mem)
        shutil.rmtree(self.mem, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def criu_bin() -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not CRIU.exists():
        pytest.skip(f"no CRIU at {CRIU}")
    ok, out = criu.check(CRIU)
    if not ok:
        pytest.skip(f"criu check failed: {out[-300:]}")
    return CRIU


def _build(tmp: Path, name: str, *flags: str) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    out = tmp / name
    subprocess.run(
        [gcc, "-O2", "-pthread", *flags, "-o", str(out), str(PROGS / "memprog.c"), "-ldl"],
        check=True,
    )
    return out


@pytest.fixture(scope="module")
def memprog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory.mktemp("memprog"), "memprog")


@pytest.fixture(scope="module")
def reaper() -> Iterator[None]:
    """Make this process the subreaper of restored clones, so they can be reaped."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    yield None
    prctl(PR_SET_CHILD_SUBREAPER, 0)
    _reap_all()


@pytest.fixture(scope="module")
def trap_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the SIGSYS handler is built, once for the module."""
    return tmp_path_factory.mktemp("sigsys")


@pytest.fixture
def lab(criu_bin: Path, memprog: Path, reaper: None, tmp_path: Path, trap_cache: Path) -> Iterator[Lab]:
    lab = Lab(criu_bin, memprog, tmp_path, trap_cache)
    yield lab
    lab.close()


def _sums(lab: Lab, pid: int) -> dict[str, str]:
    return lab.cmd(pid, "sum")


# ------------------------------------------------------- unit: no CRIU needed


def test_split_cuts_page_map_entries_at_vma_boundaries() -> None:
    vmas = [
        {"start": 0x10000, "end": 0x13000},
        {"start": 0x13000, "end": 0x20000},
        {"start": 0x30000, "end": 0x31000},
    ]
    entries = [
        {"vaddr": 0x11000, "nr_pages": 4, "flags": 6},  # crosses the first boundary
        {"vaddr": 0x1F000, "nr_pages": 1, "flags": 1},  # in a parent image: no data here
        {"vaddr": 0x30000, "nr_pages": 1, "flags": 4},
    ]
    pieces = image_io.split(entries, vmas)
    assert [(p.start, p.end, p.src, p.vma) for p in pieces] == [
        (0x11000, 0x13000, 0, 0),
        (0x13000, 0x15000, 2 * PAGE, 1),
        (0x1F000, 0x20000, None, 1),
        (0x30000, 0x31000, 4 * PAGE, 2),
    ]


def test_glibc_chunks_split_merged_mmaps() -> None:
    headers = {0x100000: (0, 0x3000 | 2), 0x103000: (0, 0x5000 | 2)}
    assert plan.glibc_chunks(headers.get, 0x100000, 0x108000) == [
        (0x100000, 0x103000),
        (0x103000, 0x108000),
    ]
    # an area that is not a run of mmapped chunks stays whole, a partial run keeps its rest
    assert plan.glibc_chunks({}.get, 0x100000, 0x108000) == [(0x100000, 0x108000)]
    assert plan.glibc_chunks({0x100000: (0, 0x2000 | 2)}.get, 0x100000, 0x108000) == [
        (0x100000, 0x102000),
        (0x102000, 0x108000),
    ]
    # non-main-arena or unaligned sizes are not mmapped chunks
    assert plan.glibc_chunks({0x100000: (0, 0x2000 | 2 | 4)}.get, 0x100000, 0x108000) == [
        (0x100000, 0x108000)
    ]


def test_slots_leave_growth_room_and_keep_huge_page_alignment() -> None:
    slots = rewrite.Slots(growth_room=1 << 30)
    a = slots.place(0x7F0000201000, 0x5000)
    b = slots.place(0x7F0000400000, 0x1000)
    assert a % (2 << 20) == 0x1000 and b % (2 << 20) == 0
    assert b >= a + 0x5000 + (1 << 30)


def test_file_ranges_convert_written_runs_inside_the_file() -> None:
    k = 1024
    gap = filemaps.CLEAN_GAP
    # a small area with a few written pages: all of it (clean runs are short)
    assert filemaps.file_ranges(0, 64 * k, 64 * k, [(8 * k, 12 * k)]) == [(0, 64 * k, True)]
    # past the file's end: only the part inside the file
    assert filemaps.file_ranges(0, 64 * k, 16 * k, [(0, 4 * k)]) == [
        (0, 16 * k, True),
        (16 * k, 64 * k, False),
    ]
    # long clean runs stay mapped to the file
    far = 4 * gap
    assert filemaps.file_ranges(0, 3 * far, 3 * far, [(far, far + 4 * k)]) == [
        (0, far, False),
        (far, far + 4 * k, True),
        (far + 4 * k, 3 * far, False),
    ]
    # runs closer than the gap are joined, and reach a near end
    assert filemaps.file_ranges(
        0, far, far, [(far - gap, far - gap + 4 * k), (far - 8 * k, far)]
    ) == [
        (0, far - gap, False),
        (far - gap, far, True),
    ]
    # nothing written inside the file: nothing to convert
    assert filemaps.file_ranges(0, 64 * k, 0, [(0, 4 * k)]) == [(0, 64 * k, False)]


def test_gaps_are_the_uncovered_ranges() -> None:
    assert rewrite._gaps(0, 100, [(10, 20), (20, 30), (50, 100)]) == [(0, 10), (30, 50)]
    assert rewrite._gaps(0, 100, []) == [(0, 100)]


def test_write_data_leaves_zero_pages_as_holes() -> None:
    src_path = Path("/dev/shm") / f"bunshin-test-src-{uuid.uuid4().hex[:8]}"
    dst_path = src_path.with_name(src_path.name + "-dst")
    data = bytearray(random.Random(3).randbytes(16 * PAGE))
    data[4 * PAGE : 7 * PAGE] = bytes(3 * PAGE)  # three pages of zeros
    data[10 * PAGE] = 0  # a page starting with zeros is still data
    data[10 * PAGE + 1 : 10 * PAGE + 16] = bytes(15)
    src_path.write_bytes(data[: 15 * PAGE + 100])  # the source ends inside its last page
    try:
        src = os.open(src_path, os.O_RDONLY)
        dst = os.open(dst_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            written = fileio.write_data(src, 0, dst, 2 * PAGE, 17 * PAGE, src_end=15 * PAGE + 100)
            os.ftruncate(dst, 20 * PAGE)
            assert written == 12 * PAGE + 100
            assert list(fileio.data_extents(dst, 0, 20 * PAGE)) == [
                (2 * PAGE, 4 * PAGE),
                (9 * PAGE, 9 * PAGE),
            ]
            expect = bytes(2 * PAGE) + bytes(data[: 15 * PAGE + 100])
            assert os.pread(dst, 20 * PAGE, 0) == expect + bytes(20 * PAGE - len(expect))
            # without an end, a source shorter than asked for is an error
            with pytest.raises(RuntimeFailure):
                fileio.write_data(src, 0, dst, 2 * PAGE, 17 * PAGE)
        finally:
            os.close(src)
            os.close(dst)
    finally:
        src_path.unlink()
        dst_path.unlink(missing_ok=True)


def test_open_in_root_follows_no_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/libx.so").write_bytes(b"x" * 100)
    (root / "lib").symlink_to("usr/lib")
    (root / "usr/lib/escape.so").symlink_to("/etc/hostname")
    os.mkfifo(root / "usr/lib/fifo")
    fd = fileio.open_in_root(root, "/usr/lib/libx.so")
    assert fd is not None and os.read(fd, 10) == b"x" * 10
    os.close(fd)
    for name in (
        "/lib/libx.so",
        "/usr/lib/escape.so",
        "/usr/lib/fifo",
        "/usr/../usr/lib/libx.so",
        "usr/lib/libx.so",
        "/usr/lib/missing",
    ):
        assert fileio.open_in_root(root, name) is None, name


def _reg(fid: int, name: str, size: int, mnt_id: int) -> dict:
    return {
        "type": "REG",
        "id": fid,
        "reg": {"id": fid, "name": name, "size": size, "mnt_id": mnt_id},
    }


def _mount(mnt_id: int, mountpoint: str) -> dict:
    return {
        "fstype": 1,
        "mnt_id": mnt_id,
        "root_dev": 1,
        "parent_mnt_id": 1,
        "flags": 0,
        "root": "/",
        "mountpoint": mountpoint,
        "source": "x",
        "options": "",
    }


def test_file_sources_use_only_files_on_the_root_mount(tmp_path: Path) -> None:
    pytest.importorskip("pycriu")
    root, dump = tmp_path / "root", tmp_path / "dump"
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/libx.so").write_bytes(b"x" * 10000)
    (root / "lib").symlink_to("usr/lib")
    dump.mkdir()
    ids = {"vm_id": 1, "files_id": 1, "fs_id": 1, "sighand_id": 1}
    image_io.save({"magic": "IDS", "entries": [{**ids, "mnt_ns_id": 13}]}, dump / "ids-1.img")
    image_io.save({"magic": "IDS", "entries": [{**ids, "mnt_ns_id": 6}]}, dump / "ids-2.img")
    image_io.save(
        {"magic": "MNTS", "entries": [_mount(88, "/"), _mount(50, "/tmp")]},
        dump / "mountpoints-13.img",
    )
    image_io.save(
        {"magic": "REMAP_FPATH", "entries": [{"orig_id": 5, "remap_id": 9}]},
        dump / "remap-fpath.img",
    )
    files = {
        1: _reg(1, "/usr/lib/libx.so", 10000, 88),
        2: _reg(2, "/usr/lib/libx.so", 10000, 50),  # on another mount
        3: _reg(3, "/usr/lib/libx.so", 9999, 88),  # another size than dumped
        4: _reg(4, "/lib/libx.so", 10000, 88),  # through a symlink
        5: _reg(5, "/usr/lib/libx.so", 10000, 88),  # deleted or replaced (remapped)
        6: _reg(6, "/.bunshin/mem/a-1" + memfile.SUFFIX, 10000, 88),
    }
    with filemaps.FileSources(dump, files, root) as sources:
        src = sources.source(1, 1)
        assert src is not None and src[1] == 10000
        assert [sources.source(1, i) for i in (2, 3, 4, 5, 6)] == [None] * 5
        # a task in the host's mount namespace: its names are host paths, not under root
        assert sources.source(2, 1) is None


# ----------------------------------------------------------- real forks


@pytest.mark.criu
def test_clones_share_memory_copy_on_write(lab: Lab) -> None:
    heap = 256
    parent = lab.spawn(heap, threads=2)
    want = _sums(lab, parent)

    plain = lab.dump(parent)
    t0 = time.monotonic()
    copy = lab.restore(plain)
    plain_ms = (time.monotonic() - t0) * 1000
    assert _sums(lab, copy) == want
    plain_anon = _smaps(copy, "Anonymous")
    kill_and_wait(copy)

    images = lab.dump(parent)
    res = lab.rewrite(images)
    assert res.vmas_converted > 0 and res.bytes_moved >= heap * MIB and not res.left_anonymous
    assert res.image_bytes < 8 * MIB  # what stays in the image: [heap], stacks, libc data ...
    (mf,) = res.files
    st = mf.path.stat()
    assert (
        stat.S_IMODE(st.st_mode) == 0o444 and st.st_size == mf.size and mf.data_bytes >= heap * MIB
    )
    with pytest.raises(PermissionError):  # immutable, even for root
        open(mf.path, "r+b").close()

    before = _system_used()
    clones, times = [], []
    for _ in range(4):
        t0 = time.monotonic()
        clones.append(lab.restore(images))
        times.append((time.monotonic() - t0) * 1000)
    for c in clones:
        assert _sums(lab, c) == want
    added = _system_used() - before
    anon = [_smaps(c, "Anonymous") for c in clones]
    print(
        f"\n256 MiB heap: plain restore {plain_ms:.0f} ms, {plain_anon / MIB:.0f} MiB private; "
        f"rewritten restore {min(times):.0f}-{max(times):.0f} ms, private {[round(a / MIB, 1) for a in anon]} MiB, "
        f"4 clones +{added / MIB:.0f} MiB system-wide; rewrite {res.duration_ms:.0f} ms"
    )
    assert plain_anon > heap * MIB
    assert max(anon) < 16 * MIB
    assert added < 2 * heap * MIB  # a plain restore of 4 clones adds over 4 * heap

    # maps show the memory file where the heap block was anonymous (a documented difference)
    assert str(mf.path) in Path(f"/proc/{clones[0]}/maps").read_text()

    # writes stay private to the writer
    lab.cmd(clones[0], "write 0 8 7")
    assert _sums(lab, clones[0])["big"] != want["big"]
    for pid in (parent, *clones[1:]):
        assert _sums(lab, pid) == want
    assert 8 * MIB <= _smaps(clones[0], "Anonymous") < 8 * MIB + 16 * MIB


@pytest.mark.criu
def test_fresh_memory_reads_zero_in_clones(lab: Lab) -> None:
    """glibc thread arenas shrink (MADV_DONTNEED) and regrow; calloc, mmap, mremap growth."""
    parent = lab.spawn(32, threads=4)
    want = _sums(lab, parent)
    images = lab.dump(parent)
    lab.rewrite(images)
    clones = [lab.restore(images) for _ in range(2)]
    for c in clones:
        for _ in range(3):
            arena = lab.cmd(c, "arena")
            assert arena["stale"] == "0"  # calloc after the trim: zeros
            assert int(arena["trimmed"]) > 0  # the trim did bring back dump-time bytes
        assert lab.cmd(c, "zero") == {"bad": "0"}
        grown = lab.cmd(c, "mremap 64")
        assert grown["intact"] == "1" and grown["tail_nonzero"] == "0"
        grown = lab.cmd(c, "mremap 300")  # moved again, past the first growth
        assert grown["intact"] == "1" and grown["tail_nonzero"] == "0"
        assert _sums(lab, c)["threads"] == want["threads"]
    # the parent is unaffected
    assert _sums(lab, parent) == want


@pytest.mark.criu
def test_madv_dontneed_reads_zero_with_the_trap(lab: Lab) -> None:
    """The trap (default) makes DONTNEED exact; without it the dump-time bytes come back."""
    parent = lab.spawn(8, threads=0)
    plain, trapped, bare = (lab.dump(parent) for _ in range(3))
    res = lab.rewrite(trapped)
    assert res.vmas_converted > 0 and res.left_anonymous == ()
    lab.rewrite(bare, zero_fill=ZeroFillPolicy.CONVERT)
    assert lab.cmd(lab.restore(plain), "dontneed") == {"nonzero": "0", "dump_bytes": "0"}
    assert lab.cmd(lab.restore(trapped), "dontneed") == {"nonzero": "0", "dump_bytes": "0"}
    assert lab.cmd(lab.restore(bare), "dontneed")["dump_bytes"] == "1"


@pytest.mark.criu
@pytest.mark.skipif(not JEMALLOC.exists(), reason="needs libjemalloc2")
def test_jemalloc_process_is_converted_and_exact(lab: Lab) -> None:
    """jemalloc relies on DONTNEED zero-fill: with the trap it is shared and its calloc stays zero."""
    env = dict(
        os.environ, LD_PRELOAD=str(JEMALLOC), MALLOC_CONF="dirty_decay_ms:0,muzzy_decay_ms:0"
    )
    parent = lab.spawn(8, threads=2, env=env)
    trapped, copied, bare = (lab.dump(parent) for _ in range(3))

    res = lab.rewrite(trapped)  # default: TRAP
    assert res.vmas_converted > 0 and res.left_anonymous == ()
    clone = lab.restore(trapped)
    for _ in range(3):
        assert lab.cmd(clone, "arena")["stale"] == "0"
    (grandchild,) = _fork_of(lab, clone)
    for _ in range(2):
        assert lab.cmd(grandchild, "arena")["stale"] == "0"

    # COPY: no trap, the heuristic leaves it anonymous
    res = lab.rewrite(copied, zero_fill=ZeroFillPolicy.COPY)
    assert res.vmas_converted == 0 and [u.pid for u in res.left_anonymous] == [1]
    assert "libjemalloc" in res.left_anonymous[0].reason
    assert lab.cmd(lab.restore(copied), "arena")["stale"] == "0"

    # why: converted without the trap, jemalloc's calloc hands out purged memory as zeroed
    res = lab.rewrite(bare, zero_fill=ZeroFillPolicy.CONVERT)
    assert res.vmas_converted > 0
    assert int(lab.cmd(lab.restore(bare), "arena")["stale"]) > 0


def _fork_of(lab: Lab, pid: int) -> list[int]:
    """A clone of a clone: dump, rewrite (trap), restore."""
    images = lab.dump(pid)
    lab.rewrite(images)
    return [lab.restore(images)]


@pytest.mark.criu
def test_zero_fill_detection(lab: Lab, tmp_path: Path) -> None:
    # a statically linked jemalloc, seen in the executable's bytes
    static = _build(tmp_path, "memprog-static-jemalloc", "-DJEMALLOC_MARK")
    images = lab.dump(lab.spawn(1, threads=0, prog=static))
    (reason,) = memfile.zero_fill_risks(images).values()
    assert "contains jemalloc" in reason

    # a library named like mimalloc
    lib = tmp_path / "libmimalloc.so.2"
    (tmp_path / "empty.c").write_text("int bunshin_test_symbol;\n")
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "empty.c")], check=True
    )
    images = lab.dump(lab.spawn(1, threads=0, env=dict(os.environ, LD_PRELOAD=str(lib))))
    (reason,) = memfile.zero_fill_risks(images).values()
    assert "libmimalloc" in reason

    # plain glibc: nothing to report
    assert memfile.zero_fill_risks(lab.dump(lab.spawn(1, threads=1))) == {}


@pytest.mark.criu
def test_process_tree(lab: Lab) -> None:
    parent = lab.spawn(16, threads=1, children=2)
    procs = [parent, *_children(parent)]
    want = {i: _sums(lab, p) for i, p in enumerate(procs)}
    images = lab.dump(parent)
    res = lab.rewrite(images)
    assert len(res.files) == 3
    for _ in range(2):
        clone = lab.restore(images)
        kids = _children(clone)
        assert len(kids) == 2
        assert _sums(lab, clone) == want[0]
        assert sorted(_sums(lab, k)["big"] for k in kids) == sorted(want[i]["big"] for i in (1, 2))
        assert all(_smaps(p, "Anonymous") < 8 * MIB for p in (clone, *kids))


# A Python interpreter holding data of every origin: large bytes in glibc's main
# arena ([heap]), small objects in pymalloc arenas, a big bytearray (mmap), and
# blocks a finished thread left in its arena. "sum" hashes all of it.
PYTHON_PROG = r"""
import hashlib, os, random, signal, sys, threading
os.setsid()
ctl = sys.argv[1]
rnd = random.Random(7)
blobs = [rnd.randbytes(60_000) for _ in range(600)]
table = {i: f"value-{i}" * 3 for i in range(200_000)}
big = bytearray(rnd.randbytes(24 << 20))
side = []
t = threading.Thread(target=lambda: side.extend(random.Random(8).randbytes(100_000) for _ in range(80)))
t.start(); t.join()

def answer(*_):
    me = os.readlink("/proc/self")
    h = hashlib.sha256()
    for b in blobs + side:
        h.update(b)
    h.update(repr(sorted(table.items())[::97]).encode())
    h.update(big)
    with open(f"{ctl}/{me}.out.tmp", "w") as f:
        f.write(f"sum={h.hexdigest()[:16]} n={len(table)}")
    os.replace(f"{ctl}/{me}.out.tmp", f"{ctl}/{me}.out")

signal.signal(signal.SIGUSR1, answer)
open(f"{ctl}/{os.readlink('/proc/self')}.ready", "w").close()
while True:
    signal.pause()
"""


@pytest.mark.criu
def test_python_interpreter(lab: Lab) -> None:
    parent = lab.start([sys.executable, "-c", PYTHON_PROG, str(lab.ctl)])
    want = lab.cmd(parent, "sum")
    anon: dict[bool, int] = {}
    for convert_heap in (False, True):
        images = lab.dump(parent)
        res = lab.rewrite(images, convert_heap=convert_heap)
        assert res.vmas_converted > 0
        clones = [lab.restore(images) for _ in range(2)]
        # measured before "sum": Python's refcounting writes to every object it touches
        anon[convert_heap] = max(_smaps(c, "Anonymous") for c in clones)
        for c in clones:
            assert lab.cmd(c, "sum") == want
    print(
        f"\nPython clone private memory: [heap] anonymous {anon[False] / MIB:.1f} MiB, converted {anon[True] / MIB:.1f} MiB"
    )
    assert anon[True] < 8 * MIB
    assert anon[False] > 32 * MIB  # the 600 60 kB blobs live in [heap]


@pytest.mark.criu
def test_convert_heap_option(lab: Lab) -> None:
    parent = lab.spawn(4, threads=0)
    want = _sums(lab, parent)
    images = lab.dump(parent)
    res = lab.rewrite(images, convert_heap=True)
    clone = lab.restore(images)
    maps = Path(f"/proc/{clone}/maps").read_text()
    assert "[heap]" not in maps and str(res.files[0].path) in maps
    assert _sums(lab, clone) == want
    assert lab.cmd(clone, "zero") == {"bad": "0"}


@pytest.mark.criu
def test_failed_rewrite_leaves_images_unchanged(lab: Lab) -> None:
    images = lab.dump(lab.spawn(4, threads=0))
    before = _digest(images)
    (lab.mem / f"taken-1{memfile.SUFFIX}").write_bytes(b"")
    with pytest.raises(FileExistsError):
        lab.rewrite(images, tag="taken")
    assert _digest(images) == before
    assert [p.name for p in lab.mem.iterdir()] == [f"taken-1{memfile.SUFFIX}"]
    assert not list(images.glob("*.rewrite"))


@pytest.mark.criu
def test_forks_of_forks(lab: Lab) -> None:
    """A chain of 9 generations: each clone writes a little, is dumped (a delta) and restored.

    With ``rebase_ratio=0.04`` (about 3 MiB of the ~70 MiB the process maps from
    its file) every third delta is folded into a fresh file.
    """
    depth = 9
    pid = lab.spawn(64, threads=1)
    want = _sums(lab, pid)
    deltas, shared, rebased = [], [], []
    for gen in range(depth):
        images = lab.dump(pid)
        res = lab.rewrite(images, rebase_ratio=0.04)
        deltas.append(res.delta_bytes)
        shared.append(res.vmas_shared + res.vmas_rebased)
        rebased.append(res.vmas_rebased > 0)
        child = lab.restore(images)
        assert _sums(lab, child) == want, f"generation {gen + 1}"
        assert _smaps(child, "Anonymous") < 16 * MIB
        lab.cmd(child, f"write {gen % 60} 1 {gen + 1}")  # 1 MiB of new writes per generation
        lab.cmd(child, "touch 3000 64")  # and 64 scattered pages
        want = _sums(lab, child)
        kill_and_wait(pid)
        pid = child
    print(
        f"\ndelta left in the image per generation (MiB): {[round(d / MIB, 2) for d in deltas]}, rebased: {rebased}"
    )
    assert deltas[0] == 0 and shared[0] == 0 and not rebased[0]
    assert all(s > 0 for s in shared[1:])
    assert any(rebased) and not all(rebased[1:])
    # a delta holds the writes since the last rebase (1 MiB + 64 pages per generation)
    assert all(
        d == 0 if r else MIB <= d < 4 * MIB for d, r in zip(deltas[1:], rebased[1:], strict=True)
    )

    # an explicit rebase folds the delta into a fresh file
    images = lab.dump(pid)
    res = memfile.rebase(images, lab.mem, trap_cache=lab.trap_cache)
    assert res.vmas_rebased > 0 and res.delta_bytes == 0
    clone = lab.restore(images)
    assert _sums(lab, clone) == want
    assert _smaps(clone, "Anonymous") < 8 * MIB


@pytest.mark.criu
def test_delta_is_restored_over_the_shared_file(lab: Lab) -> None:
    """Without rebase, a grandchild gets the clone's writes on top of the shared file."""
    parent = lab.spawn(32, threads=0)
    images = lab.dump(parent)
    lab.rewrite(images)
    clone = lab.restore(images)
    lab.cmd(clone, "write 4 2 9")
    lab.cmd(clone, "alloc 6")  # new anonymous memory in the clone
    want = _sums(lab, clone)
    images2 = lab.dump(clone)
    res = lab.rewrite(images2, rebase_ratio=None)
    assert res.vmas_shared > 0 and res.vmas_converted > 0 and len(res.files) == 1
    assert res.bytes_moved >= 6 * MIB  # the new area went into a new file
    assert 2 * MIB <= res.delta_bytes < 3 * MIB  # the writes stayed in the image
    for _ in range(2):
        grandchild = lab.restore(images2)
        assert _sums(lab, grandchild) == want
        assert 2 * MIB <= _smaps(grandchild, "Anonymous") < 10 * MIB
    first = memfile.referenced_memfiles(images)
    assert first < memfile.referenced_memfiles(images2)
    assert {Path(n).name for n in first} == {p.name for p in lab.mem.glob(f"*{memfile.SUFFIX}")} - {
        res.files[0].path.name
    }


# ------------------------------------------- written file mappings, zero pages

KIB = 1 << 10
BLOB_KIB = 8192
BLOB_ZERO_PAGE_KIB = 5760  # the blob holds one page of zeros here


@pytest.fixture(scope="module")
def libblob(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libblob.so, whose .data is ``blob`` next to it: 8 MiB of random bytes."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    d = tmp_path_factory.mktemp("libblob")
    data = bytearray(random.Random(5).randbytes(BLOB_KIB * KIB))
    data[BLOB_ZERO_PAGE_KIB * KIB : BLOB_ZERO_PAGE_KIB * KIB + PAGE] = bytes(PAGE)
    (d / "blob").write_bytes(data)
    out = d / "libblob.so"
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            f'-DBLOB="{d / "blob"}"',
            "-o",
            str(out),
            str(PROGS / "libblob.c"),
        ],
        check=True,
    )
    return out


@pytest.mark.criu
def test_written_library_data_is_shared_copy_on_write(lab: Lab, libblob: Path) -> None:
    """A library's written .data: clones share it, see the same bytes, write privately."""
    parent = lab.spawn(1, threads=0, env=dict(os.environ, MEMPROG_LIB=str(libblob)))
    info = lab.cmd(parent, "lib")
    addr, n = int(info["addr"], 16), int(info["len"])
    blob = (libblob.parent / "blob").read_bytes()
    assert n == len(blob) and _read_mem(parent, addr, n) == blob
    # written: 2 MiB, then 256 KiB of zeros; 3.25 MiB untouched; 3 pages far apart
    for c in (
        "lfill 0 2048 11",
        "lzero 2048 256",
        "lfill 5632 8 12",
        "lfill 6144 4 13",
        "lfill 8188 4 14",
    ):
        lab.cmd(parent, c)
    want = _read_mem(parent, addr, n)
    assert want[2048 * KIB : 2304 * KIB] == bytes(256 * KIB)
    assert want[2304 * KIB : 5632 * KIB] == blob[2304 * KIB : 5632 * KIB]

    anon_only = lab.dump(parent)
    lab.rewrite(anon_only, convert_heap=True, file_maps=False)
    dump = lab.dump(parent)
    res = lab.rewrite(dump, convert_heap=True)
    assert res.vmas_file >= 3  # the blob's three written runs (and other libraries' data)
    assert res.zero_bytes >= 256 * KIB
    (mf,) = res.files

    # the zeros are holes in the memory file: the page the process zeroed, and the
    # page of zeros the library file holds (read from the file, not the image)
    vmas = image_io.load(dump / "mm-1.img")["entries"][0]["vmas"]
    fd = os.open(mf.path, os.O_RDONLY)
    try:
        for off_kib, length in ((2048, 256 * KIB), (BLOB_ZERO_PAGE_KIB, PAGE)):
            a = addr + off_kib * KIB
            (v,) = [v for v in vmas if v["start"] <= a < v["end"]]
            slot = v["pgoff"] + a - v["start"]
            assert os.lseek(fd, slot, os.SEEK_DATA) >= slot + length
    finally:
        os.close(fd)

    plain = lab.restore(anon_only)
    assert _read_mem(plain, addr, n) == want
    clones = [lab.restore(dump) for _ in range(3)]
    anon = [_smaps(c, "Anonymous") for c in clones]
    for c in clones:
        assert _read_mem(c, addr, n) == want
    print(
        f"\nwritten library data: clone private {_smaps(plain, 'Anonymous') / KIB:.0f} KiB "
        f"(anonymous memory converted), {max(anon) / KIB:.0f} KiB (library data too)"
    )
    assert _smaps(plain, "Anonymous") > 2 * MIB
    assert max(anon) < 512 * KIB

    # what /proc/PID/maps shows: the memory file where the library was written,
    # the library itself where it was not
    assert _mapping(clones[0], addr + 1024 * KIB)[2] == str(mf.path)
    assert _mapping(clones[0], addr + 4096 * KIB)[2] == str(libblob)
    assert _mapping(clones[0], addr + 5700 * KIB)[2] == str(mf.path)

    # a clone's writes stay its own, in converted and in unconverted parts
    lab.cmd(clones[0], "lfill 100 8 77")
    lab.cmd(clones[0], "lfill 3000 8 78")
    mine = _read_mem(clones[0], addr, n)
    changed = [i for i in range(0, n, PAGE) if mine[i : i + PAGE] != want[i : i + PAGE]]
    assert changed == [
        *range(100 * KIB, 108 * KIB, PAGE),
        *range(3000 * KIB, 3008 * KIB, PAGE),
    ]
    for pid in (parent, *clones[1:]):
        assert _read_mem(pid, addr, n) == want


@pytest.mark.criu
def test_file_mapping_past_its_end_still_faults(lab: Lab, tmp_path: Path) -> None:
    """Only the part inside the file is converted: beyond it, access still faults (SIGBUS)."""
    short = tmp_path / "short"
    short.write_bytes(random.Random(9).randbytes(3 * PAGE + 100))
    parent = lab.spawn(1, threads=0)
    addr = int(lab.cmd(parent, f"fmap {short} 32 165")["addr"], 16)  # 8 pages over 3.1
    want = bytes([165]) * 4 * PAGE  # what the process wrote, past the end of the file too
    assert _read_mem(parent, addr, 4 * PAGE) == want
    with pytest.raises(OSError):
        _read_mem(parent, addr + 4 * PAGE, 1)
    images = lab.dump(parent)
    res = lab.rewrite(images)
    assert res.vmas_file >= 1
    for clone in (lab.restore(images), lab.restore(images)):
        assert _read_mem(clone, addr, 4 * PAGE) == want
        assert _mapping(clone, addr)[2] == str(res.files[0].path)
        assert _mapping(clone, addr + 4 * PAGE)[1:] == (4 * PAGE, str(short))
        for page in (4, 7):
            with pytest.raises(OSError):
                _read_mem(clone, addr + page * PAGE, 1)


@pytest.mark.criu
def test_zero_pages_are_not_stored(lab: Lab) -> None:
    parent = lab.spawn(64, threads=0)
    lab.cmd(parent, "write 8 16 0")  # 16 MiB of the heap block: written zeros
    want = _sums(lab, parent)
    images = lab.dump(parent)
    res = lab.rewrite(images)
    (mf,) = res.files
    assert res.zero_bytes >= 16 * MIB - PAGE  # the block starts 16 bytes into a page
    assert mf.data_bytes <= res.bytes_moved + res.file_bytes + res.trap_bytes - res.zero_bytes
    for c in (lab.restore(images), lab.restore(images)):
        assert _sums(lab, c) == want
        assert lab.cmd(c, "zero") == {"bad": "0"}
    # the zeros read as zeros once, then are written privately like any page
    lab.cmd(c, "write 8 1 9")
    assert _sums(lab, c)["big"] != want["big"]
    assert _sums(lab, parent) == want


IDLE_PYTHON = r"""
import hashlib, json, os, signal, socket, ssl, sys
os.setsid()
ctl = sys.argv[1]

def answer(*_):
    me = os.readlink("/proc/self")
    with open(f"{ctl}/{me}.out.tmp", "w") as f:
        f.write(f"n={len(sys.modules)}")
    os.replace(f"{ctl}/{me}.out.tmp", f"{ctl}/{me}.out")

signal.signal(signal.SIGUSR1, answer)
open(f"{ctl}/{os.readlink('/proc/self')}.ready", "w").close()
while True:
    signal.pause()
"""


@pytest.mark.criu
def test_idle_python_clone_owns_little(lab: Lab) -> None:
    """Most of an idle interpreter's own pages are its libraries' written data."""
    parent = lab.start([sys.executable, "-c", IDLE_PYTHON, str(lab.ctl)])
    want = lab.cmd(parent, "sum")
    anon: dict[bool, int] = {}
    for file_maps in (False, True):
        images = lab.dump(parent)
        lab.rewrite(images, convert_heap=True, file_maps=file_maps)
        clones = [lab.restore(images) for _ in range(2)]
        anon[file_maps] = max(_smaps(c, "Anonymous") for c in clones)
        for c in clones:
            assert lab.cmd(c, "sum") == want
    print(
        f"\nidle Python clone private memory: {anon[False] / KIB:.0f} KiB (anonymous memory "
        f"converted), {anon[True] / KIB:.0f} KiB (written file mappings too)"
    )
    assert anon[True] <= 1 * MIB < anon[False]


# ------------------------------------------------------------------ the trap (semprog)

SEM_CHECKS = {
    "dontneed": {"dn": "0", "dnl": "0"},
    "mremap": {"tail": "0", "head": "1"},
    "free": {"free": "0", "errno": "0", "valid": "1"},
    "wipe": {"wipe": "0", "errno": "0", "child": "0", "keep": "1"},
    "fmap": {"file": "1", "before": "1"},
    "blocked": {"dn": "0", "dnl": "0"},
    "forkchild": {"status": "0"},
    "exec": {"status": "0"},
    "spawn": {"r": "0", "status": "0"},
    "mask": {"kept": "1", "gone": "1"},
    "locked": {"r": "-1", "errno": "22", "kept": "1"},
}
OWN_CHECKS = {"own": {"got": "2", "ret": "4242"}, "resig": {"r": "0", "old": "1"}}


@pytest.fixture(scope="module")
def semprog(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """semprog.c built, and the data file its private file mapping maps."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    d = tmp_path_factory.mktemp("semprog")
    subprocess.run(
        ["gcc", "-O2", "-pthread", "-o", str(d / "semprog"), str(PROGS / "semprog.c")], check=True
    )
    (d / "data.bin").write_bytes(random.Random(16).randbytes(64 * 1024))
    return d / "semprog", d / "data.bin"


def _semantics(lab: Lab, pid: int, checks: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """What each check answers in ``pid`` (run twice: a second call sees the first's effects)."""
    got = {name: lab.cmd(pid, name) for name in checks}
    got.update({f"{name} again": lab.cmd(pid, name) for name in ("dontneed", "mremap", "wipe")})
    return got


def _want(checks: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    return {**checks, **{f"{name} again": SEM_CHECKS[name] for name in ("dontneed", "mremap", "wipe")}}


@pytest.mark.criu
@pytest.mark.parametrize("variant", ["plain", "own", "noquery"], ids=["plain", "own-sigsys-handler", "no-procmap-query"])
def test_converted_memory_keeps_linux_semantics(lab: Lab, semprog: tuple[Path, Path], variant: str) -> None:
    """DONTNEED, mremap, FREE, WIPEONFORK, file DONTNEED: as in the parent, in clones and forks of forks.

    Also in a fork() child and a vfork child of a clone, in a thread that blocks every
    signal, and in a program exec'd in a clone (the filter outlives exec, the handler
    does not: it must not be trapped). ``own``: the program's own SIGSYS handler and
    seccomp trap keep working, also after it installs its handler again. ``noquery``:
    its own filter refuses PROCMAP_QUERY (as kernels before 6.11 do), the handler reads
    the maps text instead.
    """
    prog, data = semprog
    checks = {**SEM_CHECKS, **(OWN_CHECKS if variant == "own" else {})}
    parent = lab.start([str(prog), str(lab.ctl), str(data), *([variant] if variant != "plain" else [])])
    assert _semantics(lab, parent, checks) == _want(checks)
    images = lab.dump(parent)
    res = lab.rewrite(images)
    assert res.vmas_converted >= 1 and res.vmas_file >= 1 and res.left_anonymous == ()
    clones = [lab.restore(images), lab.restore(images)]
    # converted memory is shared: a clone owns a fraction of the parent's memory (until
    # the checks make parts of it anonymous again: mremap and WIPEONFORK copy their area)
    assert _smaps(clones[1], "Anonymous") < _smaps(parent, "Anonymous") // 4
    for c in clones:
        assert _semantics(lab, c, checks) == _want(checks)
    (grandchild,) = _fork_of(lab, clones[0])
    assert _semantics(lab, grandchild, checks) == _want(checks)
    (great,) = _fork_of(lab, grandchild)
    assert _semantics(lab, great, checks) == _want(checks)


@pytest.mark.criu
def test_forks_of_forks_replace_the_trap(lab: Lab, semprog: tuple[Path, Path]) -> None:
    """A clone's dump holds the handler and filter: kept once, the filter replaced, never stacked."""
    prog, data = semprog
    pid = lab.start([str(prog), str(lab.ctl), str(data)])
    for _ in range(3):
        images = lab.dump(pid)
        lab.rewrite(images)
        chain = _filter_chain(images, 1)
        assert [trapcode.is_ours(f) for f in chain] == [True]
        pid = lab.restore(images)
        lab.cmd(pid, "dontneed")  # new anonymous memory for the next rewrite to convert
        lab.cmd(pid, "mremap")
    handlers = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if " r-xp " in line
                and memfile.SUFFIX in line]
    assert len(handlers) == 1, handlers


@pytest.mark.criu
def test_a_clone_whose_trap_is_another_versions_keeps_it(lab: Lab, semprog: tuple[Path, Path], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A clone made by another bunshin (its handler's code differs: the filter traps what that
    handler handles) keeps its handler and filter as they are; memory written since is copied."""
    prog, data = semprog
    images = lab.dump(lab.start([str(prog), str(lab.ctl), str(data)]))
    source = trapcode._source()
    other = source.replace(b"g[R_RAX] = ret;", b'g[R_RAX] = ret;\n    __asm__ volatile("nop");')
    assert other != source
    monkeypatch.setattr(trapcode, "_source", lambda: other)
    memfile.rewrite_images(images, lab.mem, trap_cache=tmp_path / "other")
    theirs = _filter_chain(images, 1)
    monkeypatch.undo()
    clone = lab.restore(images)
    lab.cmd(clone, "dontneed")  # new anonymous memory
    images = lab.dump(clone)
    res = lab.rewrite(images)
    assert [u.pid for u in res.left_anonymous] == [1]
    assert "another bunshin version's" in res.left_anonymous[0].reason
    assert _filter_chain(images, 1) == theirs  # not replaced, not stacked
    assert _semantics(lab, lab.restore(images), SEM_CHECKS) == _want(SEM_CHECKS)


def _filter_chain(images: Path, tid: int) -> list[bytes]:
    filters = image_io.load(images / "seccomp.img")["entries"][0]["seccomp_filters"]
    core = image_io.load(images / f"core-{tid}.img")["entries"][0]["thread_core"]
    out, i = [], core.get("seccomp_filter")
    while i is not None:
        out.append(base64.b64decode(filters[i]["filter"]))
        i = filters[i].get("prev")
    return out


@pytest.mark.criu
def test_a_process_that_cannot_get_the_trap_is_copied_or_refused(lab: Lab, tmp_path: Path) -> None:
    """No room for the handler's table (here: a memory-file view too long for it): exact either way."""
    parent = lab.spawn(8, threads=0)
    copied, refused = lab.dump(parent), lab.dump(parent)
    view = str(lab.mem) + "/" + "v" * 120
    before = _digest(refused)
    with pytest.raises(NotForkable) as exc:
        lab.rewrite(refused, zero_fill=ZeroFillPolicy.REFUSE, memfile_view=view)
    assert "too long" in str(exc.value) and exc.value.hint
    assert f"process 1 ({lab.memprog} {lab.ctl} 8 0 0) of the dump" in str(exc.value)  # its command line
    assert _digest(refused) == before and not list(lab.mem.iterdir())  # nothing lost, nothing left
    res = lab.rewrite(copied, memfile_view=view)
    assert res.vmas_converted == 0 and [u.pid for u in res.left_anonymous] == [1]
    assert "SIGSYS handler" in res.left_anonymous[0].reason
    assert lab.cmd(lab.restore(copied), "dontneed") == {"nonzero": "0", "dump_bytes": "0"}


@pytest.mark.criu
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_non_pie_program(lab: Lab, semprog: tuple[Path, Path], tmp_path: Path, static: bool) -> None:
    """A copy it execs loads its text at the same addresses (and meets the filter without a handler).

    Dynamically linked (as Debian's python3): its calls go through the randomised C
    library, it is converted and exact. Statically linked: refused, copied.
    """
    _, data = semprog
    prog = tmp_path / "semprog-nopie"
    flags = ["-no-pie", *(["-static"] if static else [])]
    subprocess.run(["gcc", "-O2", "-pthread", *flags, "-o", str(prog), str(PROGS / "semprog.c")], check=True)
    parent = lab.start([str(prog), str(lab.ctl), str(data)])
    images = lab.dump(parent)
    res = lab.rewrite(images)
    if static:
        assert res.vmas_converted == 0 and res.vmas_file == 0 and res.processes_trapped == 0
        assert "statically linked and not position-independent" in res.left_anonymous[0].reason
    else:
        assert res.vmas_converted > 0 and res.processes_trapped == 1 and res.left_anonymous == ()
    clone = lab.restore(images)
    assert _semantics(lab, clone, SEM_CHECKS) == _want(SEM_CHECKS)


@pytest.mark.criu
def test_code_full_of_syscall_bytes_is_refused_early(lab: Lab, semprog: tuple[Path, Path], tmp_path: Path) -> None:
    """A process mapping 64 MiB of 0f 05 as code: the scan stops at the limit, the process is copied."""
    prog, data = semprog
    code = tmp_path / "code.bin"
    code.write_bytes(b"\x0f\x05" * (32 << 20))
    env = dict(os.environ, SEMPROG_EXEC_MAP=str(code))
    parent = lab.start([str(prog), str(lab.ctl), str(data)], env=env)
    images = lab.dump(parent)
    res = lab.rewrite(images)
    assert res.processes_trapped == 0 and res.vmas_converted == 0
    assert f"more than {sites.MAX_SITES} system call sites" in res.left_anonymous[0].reason
    assert lab.cmd(lab.restore(images), "dontneed") == SEM_CHECKS["dontneed"]


def test_an_unknown_policy_is_refused_clearly() -> None:
    assert ZeroFillPolicy("trap") is ZeroFillPolicy.TRAP
    with pytest.raises(InvalidArgument, match="unknown memory-semantics policy 'fast'") as exc:
        ZeroFillPolicy("fast")
    assert "trap, refuse, copy, convert" in (exc.value.hint or "")


def test_merge_spans_joins_the_closest_neighbours() -> None:
    spans = [(0, 10), (5, 20), (100, 110), (30, 40), (1000, 1010)]
    assert trapcode.merge_spans(spans, 10) == [(0, 20), (30, 40), (100, 110), (1000, 1010)]
    assert trapcode.merge_spans(spans, 2) == [(0, 110), (1000, 1010)]
    assert trapcode.merge_spans([], 3) == []


def test_filter_is_recognised_and_fits_bpf_limits() -> None:
    code = [(i << 32, (i << 32) + (1 << 20)) for i in range(trap.MAX_CODE_SPANS)]
    conv = [(i << 36, (i << 36) + (1 << 30)) for i in range(1, trap.MAX_CONVERTED_SPANS + 1)]
    sites = tuple(sorted({0x7F0000000000 + random.Random(i).randrange(1 << 30) for i in range(1000)}))
    prog = trapcode.filter_program((1 << 44, (1 << 44) + (1 << 20)), sites, code, conv)
    assert trapcode.is_ours(prog) and not trapcode.is_ours(seccomp.program())
    assert len(prog) // 8 <= trapcode.BPF_MAXINSNS
    with pytest.raises(ValueError, match="instructions"):
        trapcode.filter_program((0, 1), tuple(range(0, 8000, 4)), code, conv)


def test_handler_blob_builds_without_relocations(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    blob = trapcode.build_blob(tmp_path)
    assert len(blob.code) % PAGE == 0 and blob.handler < len(blob.code) and blob.restorer < len(blob.code)
    assert blob.code[blob.restorer : blob.restorer + 7] == b"\xb8\x0f\x00\x00\x00\x0f\x05"  # rt_sigreturn
    assert trapcode.build_blob(tmp_path) == blob  # cached
    table = trapcode.table_bytes("/.bunshin/mem", 1, 2, [trapcode.FileEntry(0x1000, 0x3000, 0, "/lib/x.so")])
    assert trapcode.parse_table(table) == [trapcode.FileEntry(0x1000, 0x3000, 0, "/lib/x.so")]
    assert trapcode.parse_table(bytes(len(table))) is None


def test_remove_memfile_when_another_sweep_removed_it_first(tmp_path, monkeypatch):
    """Two forks' sweeps race for one orphan: the one that finds it gone meanwhile returns."""
    from bunshin.runtime.memfile import fileio

    victim = tmp_path / "snap-x-1.bunshin-mem"
    victim.write_bytes(b"m" * 4096)
    real = fileio._open_regular

    def raced(name, dir_fd):  # the other sweep unlinks it between our stat and our open
        os.unlink(name, dir_fd=dir_fd)
        return real(name, dir_fd)

    monkeypatch.setattr(fileio, "_open_regular", raced)
    fileio.remove_memfile(victim)  # no FileNotFoundError
    assert not victim.exists()
