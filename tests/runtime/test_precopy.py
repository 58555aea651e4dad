"""Forks with live pre-copy (``Config.fork_precopy``): real workspaces, real CRIU, exact bytes, deltas after."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bunshin.errors import SnapshotNotFound, StateConflict
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.memfile.fileio import data_extents
from bunshin.runtime.snapshot import precopy
from bunshin.runtime.state.store import Store
from bunshin.workspace import Snapshot
from tests.workspace.fixtures import Family

from .test_inject import host_pid

MIB = 1 << 20

# 64 MiB of random bytes in one bytearray plus many small objects; on each request
# (a file /tmp/req) it answers the hash of everything, then changes one byte.
PROG = r"""
import hashlib, os, random, time
rnd = random.Random(5)
big = bytearray(64 << 20)
for i in range(0, len(big), 1 << 20):
    big[i:i + (1 << 20)] = rnd.randbytes(1 << 20)
small = [rnd.randbytes(3000) for _ in range(4000)]
n = 0
def digest():
    h = hashlib.sha256(big)
    for s in small:
        h.update(s)
    return h.hexdigest()[:20]
open("/tmp/ready", "w").write(digest())
while True:
    if os.path.exists("/tmp/req"):
        os.unlink("/tmp/req")
        d = digest()
        n += 1
        big[n * 4096] ^= 1
        open("/tmp/ans.tmp", "w").write(d); os.replace("/tmp/ans.tmp", "/tmp/ans")
    time.sleep(0.005)
"""


def ask(ws) -> str:
    r = ws.exec(["sh", "-c", "rm -f /tmp/ans; touch /tmp/req; while [ ! -s /tmp/ans ]; do sleep 0.01; done; cat /tmp/ans"],
                timeout=60)
    assert r.exit_code == 0, r
    return r.stdout.strip()


@pytest.fixture
def live_family(no_leaks):
    fam = Family(dataclasses.replace(no_leaks, fork_precopy=True, fork_precopy_min_mib=0))
    try:
        yield fam
    finally:
        fam.close()


def started(fam, memory: str = "1G"):
    ws = fam.create(memory=memory)
    pid = ws.commands.spawn(["python3", "-c", PROG])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            first = ws.files.read_text("/tmp/ready")
            if first:
                return ws, host_pid(ws, pid), first
        except Exception:  # not yet written
            pass
        time.sleep(0.05)
    raise AssertionError("the program did not start")


@pytest.mark.parametrize("memory", ["1G", "160M"], ids=["roomy-upper", "upper-grown"])
def test_fork_with_precopy_is_exact_and_later_forks_are_deltas(live_family, memory: str) -> None:
    """(160M: the upper's tmpfs, half of it, has no room for the live file until grown)"""
    ws, hp, first = started(live_family, memory)
    (c1,) = live_family.fork(ws, 1)
    snap = next(s for s in live_family.cfg.paths.snapshots.iterdir())  # the fork's snapshot folder
    report = json.loads((snap / precopy.REPORT).read_text())
    mine = [c for c in report["converted"] if c["pid"] == hp]
    assert mine and mine[0]["bytes"] >= 64 * MIB, report  # the program's memory went into a live file
    maps = Path(f"/proc/{hp}/maps").read_text()
    assert "/.bunshin/mem/live-" in maps  # the parent now maps it, as a clone would
    st = os.statvfs(Path(ws.record.upper).parent)
    assert st.f_bavail * st.f_frsize > 64 * MIB  # grown by what the file holds: the workspace's room kept
    # the parent and its clone each see every byte as it was, and go on apart
    want = ask(ws)
    assert want == first
    assert ask(c1) == want
    assert ask(ws) != want and ask(c1) != want  # each changed one byte of its own
    # its first clone and snapshot gone and swept: the live file stays (the parent maps it)
    c1.remove()
    with Store.open(live_family.cfg.db_path) as store:
        rsnap.sweep(live_family.cfg, store)
    assert Path(mine[0]["path"]).exists()
    # a second fork of the parent: CRIU dumps what it wrote since, not its 64 MiB again
    (c2,) = live_family.fork(ws, 1)
    snaps = sorted(live_family.cfg.paths.snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
    pages = sum(f.stat().st_size for f in (snaps[-1] / "images").glob("pages-*.img"))
    assert pages < 16 * MIB, pages
    assert ask(c2) == ask(ws)  # (both at the parent's state when forked, each one step on)


def test_a_process_started_in_a_clone_is_pre_copied_when_the_clone_forks(live_family) -> None:
    """A clone's ``/.bunshin/mem`` is its snapshot layer's: the placeholder must be made
    through the clone's merged view (made behind the overlay, in the upper, it is never seen)."""
    parent = live_family.create(memory="1G")
    (clone,) = live_family.fork(parent, 1)
    pid = clone.commands.spawn(["python3", "-c", PROG])
    deadline = time.monotonic() + 60
    while not clone.exec(["test", "-s", "/tmp/ready"]).ok:
        assert time.monotonic() < deadline, "the program did not start"
        time.sleep(0.05)
    first, hp = clone.files.read_text("/tmp/ready"), host_pid(clone, pid)
    (grandchild,) = live_family.fork(clone, 1)
    snap = max(live_family.cfg.paths.snapshots.iterdir(), key=lambda p: p.stat().st_mtime)
    report = json.loads((snap / precopy.REPORT).read_text())
    mine = [c for c in report["converted"] if c["pid"] == hp]
    assert mine and mine[0]["bytes"] >= 64 * MIB, report
    assert "/.bunshin/mem/live-" in Path(f"/proc/{hp}/maps").read_text()
    assert ask(clone) == first and ask(grandchild) == first


def _mapped_inodes(pid: int) -> set[tuple[str, int]]:
    """(path, inode) of every mapping of a live file in ``pid``'s maps."""
    out = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and "/.bunshin/mem/live-" in parts[5]:
            out.add((parts[5], int(parts[4])))
    return out


def _anon_kib(pid: int) -> int:
    return sum(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
               if ln.startswith("Anonymous:"))


def test_the_parent_and_its_clones_map_one_copy(live_family) -> None:
    """One copy of the converted memory: the parent maps the very file of ``paths.mem`` its clones map
    (by their layer's link), the upper holds only an empty placeholder, the host's mounts gain nothing."""
    cfg = live_family.cfg
    ws, hp, first = started(live_family)
    anon_before = _anon_kib(hp)
    host_mounts = Path("/proc/self/mountinfo").read_text().count("live-ws-")
    snap = live_family.snapshot(ws)
    (c1,) = live_family.restore(snap, 1)
    (path, ino), = _mapped_inodes(hp)
    name = Path(path).name
    host = cfg.paths.mem / name
    st = os.stat(host)
    assert st.st_ino == ino and st.st_uid == 0 and st.st_mode & 0o777 == 0o444
    assert st.st_blocks * 512 >= 64 * MIB  # it holds the memory
    assert _anon_kib(hp) < anon_before - 60 * 1024  # and the parent's own anonymous copy is gone
    layer_link = Path(snap.record.layer) / ".bunshin/mem" / name
    assert layer_link.stat().st_ino == st.st_ino  # the clones' layer links that inode, no copy
    nspid = int(next(ln for ln in Path(f"/proc/{hp}/status").read_text().splitlines()
                     if ln.startswith("NSpid:")).split()[-1])
    assert _mapped_inodes(host_pid(c1, nspid)) == {(path, st.st_ino)}  # the clone maps the same inode
    placeholder = Path(ws.record.upper) / ".bunshin/mem" / name
    pst = placeholder.lstat()
    assert pst.st_size == 0 and pst.st_blocks == 0 and pst.st_uid == 0  # the upper holds nothing of it
    assert list(cfg.paths.mem.glob(f"*{name}*")) == [host]  # no second copy under another name
    # the bind is in the workspace's mount namespace only
    assert Path("/proc/self/mountinfo").read_text().count("live-ws-") == host_mounts
    assert any(ln.split()[4] == path for ln in Path(f"/proc/{hp}/mountinfo").read_text().splitlines())
    assert ask(ws) == first and ask(c1) == first


def test_sweep_keeps_live_files_while_held(tmp_path: Path) -> None:
    name = f"{precopy.PREFIX}ws-0123abcd-89ab{'.bunshin-mem'}"
    f = tmp_path / name
    f.write_bytes(b"x")
    assert precopy.sweep_keeps(f, {"ws-0123abcd"})  # its workspace exists
    assert not precopy.sweep_keeps(f, {"ws-other"})  # gone, and no layer links it
    os.link(f, tmp_path / "layer-link")
    assert precopy.sweep_keeps(f, set())  # a layer still links it
    assert not precopy.sweep_keeps(tmp_path / "layer-link", {"ws-0123abcd"})  # not a live file's name


def _digest(path: Path) -> str:
    """A hash of a sparse file's data and where it lies."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, n in data_extents(fd, 0, os.fstat(fd).st_size):
            h.update(f"{off}:{n}".encode())
            h.update(os.pread(fd, n, off))
    finally:
        os.close(fd)
    return h.hexdigest()


def test_the_live_file_cannot_be_changed_from_inside(live_family) -> None:
    """Attacks from the workspace on the memory file its clones share (the bind of the host's one copy):
    all refused, the file unchanged to the byte."""
    ws, hp, first = started(live_family)
    live_family.fork(ws, 1)
    line = next(ln for ln in Path(f"/proc/{hp}/maps").read_text().splitlines() if "/live-" in ln)
    name = line.split()[-1]
    span = "-".join(f"{int(x, 16):x}" for x in line.split()[0].split("-"))  # as map_files names it
    host = live_family.cfg.paths.mem / Path(name).name
    before = os.stat(host)
    digest = _digest(host)
    attack = f"""
import ctypes, errno, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
p = {name!r}
def sys(nr, *args):
    if libc.syscall(nr, *args) < 0:
        raise OSError(ctypes.get_errno(), "")
def shared_write():
    fd = os.open(p, os.O_RDONLY)
    mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
def unshared_umount():
    libc.unshare(0x20000)  # (a mount namespace of its own, if allowed: the last attack, then)
    sys(166, p.encode(), 2)
os.makedirs("/tmp/evil", exist_ok=True)
open("/tmp/evil/f", "w").write("x")
out = []
for what, fn in [
    ("write", lambda: os.open(p, os.O_RDWR)),
    ("truncate", lambda: os.truncate(p, 0)),
    ("chmod", lambda: os.chmod(p, 0o666)),
    ("unlink", lambda: os.unlink(p)),
    ("rename", lambda: os.rename(p, "/tmp/x")),
    ("rename-dir", lambda: os.rename("/.bunshin/mem", "/tmp/m")),
    ("plant", lambda: open("/.bunshin/mem/evil.bunshin-mem", "w")),
    ("shared-write", shared_write),
    ("map-files", lambda: os.open("/proc/self/map_files/{span}", os.O_RDWR)),
    ("map-files-read", lambda: os.open("/proc/self/map_files/{span}", os.O_RDONLY)),
    ("umount", lambda: sys(166, p.encode(), 2)),
    ("bind-over", lambda: sys(165, b"/tmp/evil/f", p.encode(), None, 4096, None)),
    ("open-tree", lambda: sys(428, -100, p.encode(), 1)),
    ("mount-over-dir", lambda: sys(165, b"none", b"/.bunshin/mem", b"tmpfs", 0, None)),
    ("umount-in-own-ns", unshared_umount),
]:
    try:
        fn()
        out.append(what + ":done")
    except OSError as e:
        out.append(what + ":" + errno.errorcode.get(e.errno, str(e.errno)))
print(" ".join(out))
"""
    r = ws.exec(["python3", "-c", attack])
    got = dict(w.split(":") for w in r.stdout.split())
    assert len(got) == 15, r
    assert os.path.exists(f"/proc/{hp}/map_files/{span}")  # (the host sees that name: inside, not even that)
    assert all(v in ("EACCES", "EPERM", "EROFS", "EBUSY") or (w.startswith("map-files") and v == "ENOENT")
               for w, v in got.items()), r.stdout
    after = os.stat(host)
    assert (after.st_ino, after.st_size, after.st_mtime_ns, after.st_mode) == \
        (before.st_ino, before.st_size, before.st_mtime_ns, before.st_mode)
    assert _digest(host) == digest
    assert _mapped_inodes(hp) == {(name, before.st_ino)}  # still the host's file, still bound
    (c2,) = live_family.fork(ws, 1)  # and a later fork still works
    assert ask(ws) == first and ask(c2) == first


def test_the_bind_goes_only_on_the_hosts_placeholder(live_family) -> None:
    """``live_bind`` refuses any target but the host's empty placeholder: a file or a planted symlink in a
    folder of the workspace's, a host file holding bytes, a missing one; nothing is mounted."""
    from bunshin.runtime.memfile import live_bind
    cfg = live_family.cfg
    ws = live_family.create()
    assert ws.exec(["sh", "-c", "mkdir -p /tmp/w && ln -s /etc/passwd /tmp/w/link && : > /tmp/w/file"]).exit_code == 0
    cfg.paths.mem.mkdir(parents=True, exist_ok=True)
    mem = precopy._mem_dir(Path(ws.record.upper))  # the upper's host-owned /.bunshin/mem
    fd = os.open("full", os.O_WRONLY | os.O_CREAT, 0o444, dir_fd=mem)
    os.write(fd, b"bytes")
    os.close(fd)
    dfd = os.open(cfg.paths.mem, os.O_RDONLY | os.O_DIRECTORY)
    pidfd = os.pidfd_open(ws.record.pid)
    made = []
    try:
        before = Path(f"/proc/{ws.record.pid}/mountinfo").read_text()
        for view, name in [("/tmp/w", "file"), ("/tmp/w", "link"), ("/.bunshin/mem", "full"),
                           ("/.bunshin/mem", "missing")]:
            (cfg.paths.mem / name).write_bytes(b"canary")
            made.append(cfg.paths.mem / name)
            with pytest.raises(live_bind.BindFailed, match="not the host's|No such file"):
                live_bind.bind(dfd, name, pidfd, view)
        assert Path(f"/proc/{ws.record.pid}/mountinfo").read_text() == before
        assert "canary" not in ws.exec(["cat", "/etc/passwd", "/tmp/w/file", "/.bunshin/mem/full"]).stdout
    finally:
        os.close(pidfd)
        os.close(dfd)
        os.unlink("full", dir_fd=mem)
        os.close(mem)
        for f in made:
            f.unlink()


def _live_entries(folder: Path) -> list[dict]:
    manifest = json.loads((folder / "snapshot.json").read_text())
    return [m for m in manifest["memfiles"] if precopy.LIVE_NAME.fullmatch(m["name"])]


def test_a_pre_copied_snapshot_saves_and_loads(live_family, tmp_path: Path) -> None:
    """Its live file goes with its layer: loaded back while the workspace still holds the file (the
    same file is linked), and after everything is gone (written back from the folder), a clone has every byte."""
    cfg = live_family.cfg
    ws, hp, first = started(live_family)
    snap = live_family.snapshot(ws)
    folder = snap.save(tmp_path / "saved")
    (live,) = _live_entries(folder)
    assert live["layer"] == snap.id and sum(n for _, n in live["extents"]) >= 64 * MIB, live
    host = cfg.paths.mem / live["name"]
    snap.remove()
    with Store.open(cfg.db_path) as store:
        rsnap.sweep(cfg, store)
    assert host.exists()  # its workspace lives: kept
    loaded = Snapshot.load(folder, config=cfg)
    live_family.snapshots.append(loaded)
    (c1,) = live_family.restore(loaded, 1)
    assert ask(c1) == first
    assert os.stat(Path(loaded.record.layer) / ".bunshin/mem" / live["name"]).st_ino == host.stat().st_ino
    c1.remove()
    loaded.remove()
    ws.remove()
    with Store.open(cfg.db_path) as store:
        rsnap.sweep(cfg, store)
    assert not host.exists()  # nothing holds it any more
    again = Snapshot.load(folder, config=cfg)
    live_family.snapshots.append(again)
    (c2,) = live_family.restore(again, 1)
    assert ask(c2) == first
    assert ask(c2) != first  # (it changed one byte of its own)


def test_a_loaded_live_file_must_match_the_one_of_that_name_here(live_family, tmp_path: Path) -> None:
    """A trusted folder naming this home's live file with other bytes (its clones would map another
    workspace's memory): refused, nothing recorded, the host's file untouched."""
    cfg = live_family.cfg
    ws, hp, first = started(live_family)
    snap = live_family.snapshot(ws)
    folder = snap.save(tmp_path / "saved")
    (live,) = _live_entries(folder)
    host = cfg.paths.mem / live["name"]
    before = host.stat()
    snap.remove()
    with open(folder / live["data"], "r+b") as f:  # one byte of the saved copy changed
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StateConflict, match="other contents"):
        Snapshot.load(folder, config=cfg, trust=True)
    with pytest.raises(SnapshotNotFound):
        Snapshot.get(snap.id, config=cfg)
    after = host.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert ask(ws) == first


JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")

# jemalloc (purging at once) holds 8 blocks of 4 MiB filled with 0xAB; on each request it frees
# them (jemalloc purges them with MADV_DONTNEED and then trusts them to read zero) and callocs
# them again: it answers whether they are all zero, and where they lie
JEPROG = r"""
import ctypes, os, time
libc = ctypes.CDLL(None)
libc.malloc.restype = libc.calloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.calloc.argtypes = (ctypes.c_size_t,), (ctypes.c_size_t, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)
N = 4 << 20
blocks = [libc.malloc(N) for _ in range(8)]
for p in blocks:
    ctypes.memset(p, 0xAB, N)
open("/tmp/ready", "w").write(" ".join(hex(p) for p in blocks))
while True:
    if os.path.exists("/tmp/req"):
        os.unlink("/tmp/req")
        for p in blocks:
            libc.free(p)
        blocks = [libc.calloc(1, N) for _ in range(8)]
        zero = all(ctypes.string_at(p, N).count(0) == N for p in blocks)
        ans = ("zero " if zero else "STALE ") + " ".join(hex(p) for p in blocks)
        for p in blocks:
            ctypes.memset(p, 0xAB, N)
        open("/tmp/ans.tmp", "w").write(ans); os.replace("/tmp/ans.tmp", "/tmp/ans")
    time.sleep(0.005)
"""


def _in_live_file(pid: int, addrs: list[int]) -> bool:
    spans = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "/.bunshin/mem/live-" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            spans.append((lo, hi))
    return all(any(lo <= a < hi for lo, hi in spans) for a in addrs)


@pytest.mark.skipif(not JEMALLOC.exists(), reason="needs libjemalloc2")
def test_jemalloc_in_a_workspace_keeps_calloc_zero_after_a_live_conversion(live_family) -> None:
    """jemalloc's purged memory, mapped from the live file, must still read zero (the trap turns its
    MADV_DONTNEED into fresh zero pages): in the parent after its conversion and in its clone."""
    ws = live_family.create()
    pid = ws.commands.spawn(["env", f"LD_PRELOAD={JEMALLOC}", "MALLOC_CONF=dirty_decay_ms:0,muzzy_decay_ms:0",
                             "python3", "-c", JEPROG])
    deadline = time.monotonic() + 60
    while not ws.exec(["test", "-s", "/tmp/ready"]).exit_code == 0:
        assert time.monotonic() < deadline, "the program did not start"
        time.sleep(0.05)
    hp = host_pid(ws, pid)
    assert "libjemalloc" in Path(f"/proc/{hp}/maps").read_text()
    blocks = [int(x, 16) for x in ws.files.read_text("/tmp/ready").split()]
    N = 4 << 20
    (clone,) = live_family.fork(ws, 1)
    assert _in_live_file(hp, blocks)  # the 0xAB blocks are the file's pages now
    for w in (ws, clone, ws):
        verdict, *where = ask(w).split()
        assert verdict == "zero", where
        if w is ws:  # calloc handed out memory that was the file's when jemalloc purged it
            got = [int(a, 16) for a in where]
            assert any(b - N <= a < b + N for a in got for b in blocks), (where, blocks)


# PROG's 64 MiB as uid 1000, holding an inotify watch and a deleted file (a ghost) open;
# on a request: the heap's hash, its uid, the ghost's hash, how many watches its inotify has
MIXPROG = r"""
import ctypes, hashlib, os, random, time
libc = ctypes.CDLL(None, use_errno=True)
rnd = random.Random(7)
big = bytearray(rnd.randbytes(64 << 20))
os.makedirs("/tmp/watched", exist_ok=True)
ino = libc.inotify_init1(0)
assert libc.inotify_add_watch(ino, b"/tmp/watched", 0x100) >= 0
g = open("/tmp/ghost", "w+b"); g.write(rnd.randbytes(3 << 20)); g.flush(); os.unlink("/tmp/ghost")
def answer():
    g.seek(0)
    watches = sum(l.startswith("inotify wd:") for l in open(f"/proc/self/fdinfo/{ino}"))
    return " ".join([hashlib.sha256(big).hexdigest()[:16], str(os.getuid()),
                     hashlib.sha256(g.read()).hexdigest()[:16], str(watches)])
open("/tmp/ready.tmp", "w").write(answer()); os.replace("/tmp/ready.tmp", "/tmp/ready")
while True:
    if os.path.exists("/tmp/u/req"):
        os.unlink("/tmp/u/req")
        a = answer()
        open("/tmp/u/ans.tmp", "w").write(a); os.replace("/tmp/u/ans.tmp", "/tmp/u/ans")
    time.sleep(0.005)
"""


def test_a_converted_process_keeps_its_user_watches_and_ghost_file(live_family) -> None:
    """Users, inotify and ghost files (the fork tests' programs are under 16 MiB): here in a process the
    pre-copy converts, as the parent and its clone see them."""
    ws = live_family.create()
    assert ws.exec(["sh", "-c", "chmod 1777 /tmp && mkdir /tmp/u && chown 1000:1000 /tmp/u"]).exit_code == 0
    pid = ws.commands.spawn(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "python3", "-c", MIXPROG])
    deadline = time.monotonic() + 60
    while ws.exec(["test", "-s", "/tmp/ready"]).exit_code != 0:
        assert time.monotonic() < deadline, "the program did not start"
        time.sleep(0.05)
    first = ws.files.read_text("/tmp/ready").strip()
    assert first.split()[1:] == ["1000", first.split()[2], "1"], first
    hp = host_pid(ws, pid)
    (clone,) = live_family.fork(ws, 1)
    assert "/.bunshin/mem/live-" in Path(f"/proc/{hp}/maps").read_text()  # it was converted
    for w in (ws, clone, ws):
        r = w.exec(["sh", "-c", "rm -f /tmp/u/ans; touch /tmp/u/req; while [ ! -s /tmp/u/ans ]; do sleep 0.01; done;"
                    " cat /tmp/u/ans"], timeout=60)
        assert r.exit_code == 0 and r.stdout.strip() == first, r


_HOLDER = """
import mmap, sys, time
if sys.argv[1] == "anon":
    b = bytearray(64 << 20)
    b[::4096] = b"x" * len(range(0, len(b), 4096))  # every page written
else:  # a file's pages, read through a private mapping: cache, not anonymous memory
    f = open(sys.argv[2], "rb")
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_PRIVATE)
    sum(m[i] for i in range(0, len(m), 4096))
print("ready", flush=True)
time.sleep(60)
"""


def test_anon_bytes_is_what_a_process_wrote_not_the_files_it_reads(tmp_path: Path) -> None:
    """``anon_bytes`` (the threshold's look and the fork's space check): a process's written
    memory counts, a file it maps and reads does not, and a process that is gone holds none."""
    data = tmp_path / "data"
    data.write_bytes(os.urandom(64 << 20))
    procs = [subprocess.Popen([sys.executable, "-c", _HOLDER, kind, str(data)], stdout=subprocess.PIPE, text=True)
             for kind in ("anon", "file")]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        writer, reader = (precopy.anon_bytes(p.pid) for p in procs)
        assert writer >= 64 * MIB > 32 * MIB > reader, (writer, reader)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert precopy.anon_bytes(procs[0].pid) == 0


def test_by_default_only_a_process_above_the_threshold_is_pre_copied(no_leaks) -> None:
    """On by default, from ``fork_precopy_min_mib`` (1 GiB) up: the program's ~64 MiB is left
    to CRIU's dump (no report, no live file); with the threshold under it, it is pre-copied."""
    from bunshin.config import Config

    assert Config.fork_precopy is True and Config.fork_precopy_min_mib == 1024
    for least, copied in ((1024, False), (32, True)):
        fam = Family(dataclasses.replace(no_leaks, fork_precopy=True, fork_precopy_min_mib=least))
        try:
            ws, hp, first = started(fam)
            assert precopy.wanted(fam.cfg, [hp]) is copied
            (c1,) = fam.fork(ws, 1)
            snap = next(s for s in fam.cfg.paths.snapshots.iterdir())
            assert (snap / precopy.REPORT).exists() is copied
            assert ("/.bunshin/mem/live-" in Path(f"/proc/{hp}/maps").read_text()) is copied
            assert ask(ws) == ask(c1) == first
        finally:
            fam.close()


def test_a_threshold_that_is_not_a_number_is_refused_before_anything_is_frozen(no_leaks, monkeypatch) -> None:
    from bunshin.config import Config
    from bunshin.errors import InvalidArgument

    monkeypatch.setenv("BUNSHIN_FORK_PRECOPY_MIN_MIB", "lots")
    assert Config.from_env().fork_precopy_min_mib == "lots"
    monkeypatch.setenv("BUNSHIN_FORK_PRECOPY_MIN_MIB", "64")
    assert Config.from_env().fork_precopy_min_mib == 64
    fam = Family(dataclasses.replace(no_leaks, fork_precopy=True, fork_precopy_min_mib="lots"))
    try:
        ws, hp, first = started(fam)
        with pytest.raises(InvalidArgument) as e:
            fam.fork(ws, 1)
        assert "BUNSHIN_FORK_PRECOPY_MIN_MIB" in (e.value.hint or "")
        assert ask(ws) == first  # the workspace runs on, untouched
        assert not any(fam.cfg.paths.mem.glob("live-*"))
    finally:
        fam.close()


def test_a_malformed_cpu_boost_is_refused_before_anything_is_frozen(live_family, monkeypatch) -> None:
    from bunshin.errors import InvalidArgument
    from bunshin.runtime.criu import fork_boost

    ws, hp, first = started(live_family)
    monkeypatch.setenv(fork_boost.ENV, "much")
    with pytest.raises(InvalidArgument) as e:
        live_family.fork(ws, 1)
    assert fork_boost.ENV in str(e.value) and "default weight" in (e.value.hint or "")
    assert ask(ws) == first  # the workspace runs on, untouched
    assert not any(live_family.cfg.paths.mem.glob("live-*"))
    monkeypatch.setenv(fork_boost.ENV, "3")
    (c1,) = live_family.fork(ws, 1)
    snap = next(s for s in live_family.cfg.paths.snapshots.iterdir())
    report = json.loads((snap / precopy.REPORT).read_text())
    assert report["converted"] and report["cpu_boost"] == (3 if fork_boost.cpu_root() else 1)
    assert ask(c1) == ask(ws)  # (one step on from first, each)
    assert not any(p.name.startswith(fork_boost.PREFIX) for p in (fork_boost.cpu_root() or Path("/nonexistent")).glob("*"))
