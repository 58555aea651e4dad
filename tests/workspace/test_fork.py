"""Integration: the live fork of real workspaces (CRIU, copy-on-write memory files).

Every test removes what it creates (also on failure) and runs under ``no_leaks``,
which also checks snapshot records and the tmpfs ``snapshots``, ``mem`` and
``layers`` folders.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bunshin.config import Config
from bunshin.errors import (
    CriuError,
    InvalidArgument,
    SnapshotNotFound,
    StateConflict,
    WorkspaceNotFound,
)
from bunshin.runtime.container import statefs
from bunshin.runtime.criu import netns_image
from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
from bunshin.runtime.snapshot import sweeping as rsnap_sweeping
from bunshin.runtime.snapshot import taking as rsnap_taking
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Session, Snapshot, Workspace
from bunshin.workspace.family import SnapshotNode, WorkspaceNode, build
from tests.conftest import drop_state_tmpfs, leftovers
from tests.runtime.procs import fork_bomb

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"
HEAP_MIB = 64


# ------------------------------------------------------------------- helpers


def start_probe(ws: Workspace, mib: int = HEAP_MIB) -> str:
    """Start the heap probe inside ``ws``; returns its heap checksum."""
    ws.files.write("/root/probe.py", (PROGS / "probe.py").read_bytes())
    ws.commands.spawn(["python3", "/root/probe.py", str(mib)])
    return wait_file(ws, "/tmp/probe.ready")


def wait_file(ws: Workspace, path: str, timeout: float = 60) -> str:
    r = ws.exec(["sh", "-c", 'while [ ! -s "$1" ]; do sleep 0.02; done; cat "$1"', "sh", path], timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, r
    return r.stdout.strip()


def ask(ws: Workspace, request: str, timeout: float = 60) -> str:
    """One request to the probe of ``ws``; its answer."""
    script = ('rm -f /tmp/probe.out; printf "%s\\n" "$1" > /tmp/probe.req.tmp && mv /tmp/probe.req.tmp /tmp/probe.req;'
              ' while [ ! -e /tmp/probe.out ]; do sleep 0.01; done; cat /tmp/probe.out')
    r = ws.exec(["sh", "-c", script, "sh", request], timeout=timeout)
    assert r.exit_code == 0 and not r.timed_out, r
    return r.stdout.strip()


def cgroup_value(ws: Workspace, *names: str) -> str:
    for _, d in ws.record.cgroups:
        for name in names:
            f = Path(d) / name
            if f.exists():
                return f.read_text().strip()
    raise AssertionError(f"none of {names} in the cgroups of {ws.id}")


# ------------------------------------------------------------------- memory


def test_clone_heap_equals_parent_then_diverges(family):
    ws = family.create()
    before = start_probe(ws)
    a, b = family.fork(ws, 2)
    assert ask(a, "sum") == ask(b, "sum") == ask(ws, "sum") == before
    changed = ask(a, "write clone-a")
    assert changed != before
    assert ask(a, "sum") == changed
    assert ask(b, "sum") == before and ask(ws, "sum") == before
    # the heap stays shared: a clone owns little of its own memory right after the fork
    assert b.stats().memory.anon_bytes < (HEAP_MIB << 20) // 2
    assert ws.last_fork is not None and ws.last_fork.memfile_bytes >= HEAP_MIB << 20


def test_clone_maps_its_dense_heap_with_huge_pages(family):
    """On bunshin's huge-page tmpfs a clone maps a dense heap 2 MiB per page-table entry (the
    rewrite's memory files; a live pre-copy's files have small pages: README "Piece by piece")."""
    family.cfg = dataclasses.replace(family.cfg, fork_precopy=False)
    ws = family.create()
    if not statefs.huge_memfiles(family.cfg):
        pytest.skip("bunshin's tmpfs has no huge pages here")
    before = start_probe(ws)
    (c,) = family.fork(ws, 1)
    assert ask(c, "sum") == before  # reads every page of the heap
    probe = next(p for p in psutil.Process(c.record.pid).children(recursive=True)
                 if "probe.py" in " ".join(p.cmdline()))
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{probe.pid}/smaps_rollup").read_text().splitlines()[1:])
    assert int(rollup["ShmemPmdMapped"].split()[0]) >= (HEAP_MIB << 10) // 2  # KiB
    assert ask(c, "write clone") != before and ask(ws, "sum") == before  # a write still copies one page


def test_fresh_memory_reads_zero_in_clones(family):
    ws = family.create()
    start_probe(ws)
    for c in family.fork(ws, 2):
        assert ask(c, "fresh") == "ok"
    assert ask(ws, "fresh") == "ok"


def test_madv_dontneed_on_forked_memory_reads_zero(family):
    """Converted memory reads zeros after MADV_DONTNEED (the trap), in clones and forks of forks."""
    ws = family.create()
    start_probe(ws)
    (c,) = family.fork(ws, 1)
    assert ask(c, "dontneed") == "zero"
    (cc,) = family.fork(c, 1)
    assert ask(cc, "dontneed") == "zero"
    assert ask(ws, "dontneed") == "zero"


def test_programs_exec_d_in_a_clone_are_not_trapped(family):
    """The filter outlives exec, the handler does not: Python exec'ing Python (same addresses for
    its non-PIE executable) and madvising runs as it would, in a clone and a fork of a fork."""
    ws = family.create()
    start_probe(ws)
    (c,) = family.fork(ws, 1)
    (cc,) = family.fork(c, 1)
    for w in (c, cc):
        assert ask(w, "spawn 20") == "failed 0"


def test_a_program_started_in_a_clone_is_exact_in_its_forks(family):
    """A program exec'd in a clone inherits the clone's filter without its handler; forked, it
    gets a handler of its own and the inherited filter is replaced (at restore: a live pre-copy
    of the program in ``c`` could only add its filter to the inherited one, a third)."""
    family.cfg = dataclasses.replace(family.cfg, fork_precopy=False)
    ws = family.create()
    (c,) = family.fork(ws, 1)
    start_probe(c)
    assert ask(c, "dontneed") == "zero"  # never converted: not trapped
    (cc,) = family.fork(c, 1)
    for req, want in (("dontneed", "zero"), ("mremap 64", "ok"), ("fresh", "ok"), ("spawn 3", "failed 0")):
        assert ask(cc, req) == want
    probe = next(p for p in psutil.Process(cc.record.pid).children(recursive=True)
                 if "probe.py" in " ".join(p.cmdline()))
    status = Path(f"/proc/{probe.pid}/status").read_text()
    assert "Seccomp_filters:\t2" in status  # bunshin's and one trap filter, not two


def test_madv_dontneed_in_copy_mode_reads_zero(family):
    ws = family.create()
    start_probe(ws)
    (c,) = family.fork(ws, 1, mode="copy")
    assert ask(c, "dontneed") == "zero"
    assert ask(ws, "dontneed") == "zero"


def test_mremap_and_realloc_growth_in_clone(family):
    ws = family.create()
    start_probe(ws)
    a, b = family.fork(ws, 2)
    assert ask(a, "mremap 64") == "ok"
    assert ask(a, "realloc 96") == "ok"
    assert ask(b, "realloc 32") == "ok"
    assert ask(b, "mremap 512") == "ok"
    assert ask(ws, "mremap 64") == "ok"


def _arenas_status(ws: Workspace) -> tuple[int, int]:
    rounds, stale = ws.files.read_text("/tmp/arenas.status").split()
    return int(rounds), int(stale)


def test_glibc_arenas_never_return_stale_bytes(family, tmp_path):
    binary = tmp_path / "arenas"
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(binary), str(PROGS / "arenas.c")], check=True)
    ws = family.create()
    ws.files.write("/root/arenas", binary.read_bytes(), mode=0o755)
    ws.commands.spawn(["/root/arenas", "4"])
    wait_file(ws, "/tmp/arenas.status")
    time.sleep(1.0)  # arenas grown, shrunk and dirty at the fork
    clones = family.fork(ws, 2)
    clones += family.fork(clones[0], 1)  # and a fork of a fork
    start = {c.id: _arenas_status(c)[0] for c in clones}
    time.sleep(3.0)
    for c in [ws, *clones]:
        rounds, stale = _arenas_status(c)
        assert stale == 0, f"{c.id}: calloc returned {stale} stale bytes"
        if c is not ws:
            assert rounds > start[c.id] + 10, f"{c.id} made no progress"


# -------------------------------------------------------------------- files


def test_files_parent_changes_visible_clone_writes_private(family):
    ws = family.create()
    ws.files.write("/root/shared.txt", "from the parent\n")
    ws.exec("mkdir -p /work && echo old > /work/doomed && dd if=/dev/urandom of=/work/blob bs=1M count=4 2>/dev/null")
    blob = ws.exec("sha256sum /work/blob").stdout.split()[0]
    ws.files.remove("/work/doomed")
    a, b = family.fork(ws, 2)
    for c in (a, b):
        assert c.files.read_text("/root/shared.txt") == "from the parent\n"
        assert c.exec("sha256sum /work/blob").stdout.split()[0] == blob
        assert c.exec(["test", "-e", "/work/doomed"]).exit_code == 1
    a.files.write("/root/shared.txt", "changed by a\n")
    a.files.write("/root/only-a", "a\n")
    ws.files.write("/root/after-fork", "parent later\n")
    assert b.files.read_text("/root/shared.txt") == "from the parent\n"
    assert ws.files.read_text("/root/shared.txt") == "from the parent\n"
    assert b.exec(["test", "-e", "/root/only-a"]).exit_code == 1
    assert ws.exec(["test", "-e", "/root/only-a"]).exit_code == 1
    assert a.exec(["test", "-e", "/root/after-fork"]).exit_code == 1
    assert a.files.read_text("/root/shared.txt") == "changed by a\n"


# ----------------------------------------------------- processes and sessions


def test_bash_session_state_carries(family):
    ws = family.create()
    sh = ws.shell()
    sh.run("mkdir -p /tmp/here && cd /tmp/here && export EXPORTED=e1 && PLAIN=p1 && greet() { echo hi-$1; }")
    sh.run("echo history-marker")
    clones = family.fork(ws, 2)
    for i, c in enumerate(clones):
        s = Session(c, sh.id)
        out = s.run("echo $PWD $EXPORTED $PLAIN; greet x; history | grep -c 'echo history-mark[e]r'").output.split()
        assert out == ["/tmp/here", "e1", "p1", "hi-x", "1"]
        # exported reaches children, the plain variable does not
        assert s.run("bash -c 'echo [$EXPORTED][$PLAIN]'").output.strip() == "[e1][]"
        s.run(f"cd / && PLAIN=clone{i}")
    assert Session(clones[1], sh.id).run("echo $PWD $PLAIN").output.strip() == "/ clone1"
    assert sh.run("echo $PWD $PLAIN").output.strip() == "/tmp/here p1"


def test_background_process_keeps_running(family):
    ws = family.create()
    pid = ws.commands.spawn(["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"])
    wait_file(ws, "/tmp/count")
    clones = family.fork(ws, 2)
    first = {c.id: int(c.files.read_text("/tmp/count")) for c in clones}
    time.sleep(1.0)
    for c in clones:
        assert int(c.files.read_text("/tmp/count")) > first[c.id] + 5
        assert str(pid) in c.exec("ps -eo pid").stdout.split()


SERVER = """
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 7777))
s.listen()
open("/tmp/listening", "w").write("yes")
while True:
    c, _ = s.accept()
    who = open("/run/bunshin/fork-id").read().strip() if os.path.exists("/run/bunshin/fork-id") else "parent"
    c.sendall(who.encode())
    c.close()
"""
CLIENT = "import socket; print(socket.create_connection(('127.0.0.1', 7777), timeout=5).recv(100).decode())"


def test_listening_socket_accepts_in_clone(family):
    ws = family.create()
    ws.commands.spawn(["python3", "-c", SERVER])
    wait_file(ws, "/tmp/listening")
    assert ws.exec(["python3", "-c", CLIENT]).stdout.strip() == "parent"
    for c in family.fork(ws, 2):
        assert c.exec(["python3", "-c", CLIENT], timeout=20).stdout.strip() == c.id
    assert ws.exec(["python3", "-c", CLIENT]).stdout.strip() == "parent"


def test_fork_id_is_the_clone_id(family):
    ws = family.create()
    clones = family.fork(ws, 3)
    ids = [c.exec(["cat", "/run/bunshin/fork-id"]).stdout.strip() for c in clones]
    assert ids == [c.id for c in clones] and len(set(ids)) == 3
    assert ws.exec(["test", "-e", "/run/bunshin/fork-id"]).exit_code == 1
    assert all(c.record.parent == ws.id for c in clones)


def test_a_symlink_at_run_bunshin_cannot_redirect_the_hosts_identity_write(family, tmp_path):
    """The host writes a clone's identity into its root: a symlink the workspace left must not be followed."""
    trap = tmp_path / "host-side"
    trap.mkdir()
    ws = family.create()
    assert ws.exec(["sh", "-c", f"rm -rf /run/bunshin && ln -s {trap} /run/bunshin"]).exit_code == 0
    (c,) = family.fork(ws, 1)
    assert list(trap.iterdir()) == []  # nothing reached the host
    assert c.exec(["cat", "/run/bunshin/fork-id"]).stdout.strip() == c.id
    assert c.exec(["test", "-L", "/run/bunshin"]).exit_code == 1  # the clone got a real folder
    assert ws.exec(["test", "-L", "/run/bunshin"]).exit_code == 0  # the parent is untouched


def test_snapshot_on_a_huge_page_tmpfs_without_the_netns(family):
    ws = family.create()
    snap = ws.snapshot()
    images = Path(snap.record.images)
    assert images.is_relative_to(statefs.images_root(family.cfg))
    assert statefs.WITHIN_SIZE in (statefs.options(statefs.images_root(family.cfg)) or "")
    # criu ran inside the workspace's netns, and no connection asks for one (netns_image)
    assert not [p for p in images.iterdir() if netns_image.NET_IMAGE.fullmatch(p.name)]
    assert (images / "stats-dump").exists() and 0 < snap.record.pause_ms < snap.record.dump_ms
    (clone,) = snap.restore(1)
    nets = {os.stat(f"/proc/{p}/ns/net").st_ino for p in (ws.record.pid, clone.record.pid, os.getpid())}
    assert len(nets) == 3  # the clone has a network namespace of its own
    probe = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print('lo up')"
    assert clone.exec(["python3", "-c", probe]).stdout == "lo up\n"
    clone.remove()
    snap.remove()
    assert not images.exists()


def test_clone_has_own_cgroup_and_limits(family):
    ws = family.create(memory="384M", pids=64)
    a, b = family.fork(ws, 2)
    dirs = [set(dict(w.record.cgroups).values()) for w in (ws, a, b)]
    assert not dirs[0] & dirs[1] and not dirs[1] & dirs[2] and not dirs[0] & dirs[2]
    for c in (a, b):
        assert c.id in Path(f"/proc/{c.record.pid}/cgroup").read_text()
        assert cgroup_value(c, "pids.max") == "64"
        assert int(cgroup_value(c, "memory.limit_in_bytes", "memory.max")) == 384 << 20
    r, peak = fork_bomb(a)
    assert r.timed_out and 32 < peak <= 64, peak
    assert a.exec(["echo", "ok"], timeout=10).stdout == "ok\n"
    assert b.stats().processes < 10 and ws.stats().processes < 10


# ------------------------------------------------------------------ lineage


def test_forks_of_forks_to_depth_8(family):
    ws = family.create()
    expected = start_probe(ws)
    chain = [ws]
    for level in range(1, 9):
        (c,) = family.fork(chain[-1], 1)
        assert ask(c, "sum") == expected, f"heap differs at depth {level}"
        for k in range(1, level):
            assert c.files.read_text(f"/root/level-{k}") == f"{k}\n"
        assert Snapshot.get(c.record.snapshot, config=family.cfg).record.depth == level
        c.files.write(f"/root/level-{level}", f"{level}\n")
        expected = ask(c, f"write level-{level}")
        chain.append(c)
    leaf = chain[-1]
    for mid in chain[1:-1]:  # the leaf holds every layer it stacks on
        mid.remove()
    assert ask(leaf, "sum") == expected
    (deeper,) = family.fork(leaf, 1)
    assert ask(deeper, "sum") == expected
    assert deeper.files.read_text("/root/level-8") == "8\n"


def test_copy_mode(family):
    ws = family.create()
    before = start_probe(ws)
    a, b = family.fork(ws, 2, mode="copy")
    snap = ws.last_fork
    assert snap is not None and snap.mode == "copy" and snap.memfile_bytes == 0
    assert ask(a, "sum") == ask(b, "sum") == before
    assert a.stats().memory.anon_bytes > HEAP_MIB << 20  # every page is its own copy
    assert ask(a, "write copy-a") != before and ask(b, "sum") == before


def test_snapshot_refcount(family):
    ws = family.create()
    a, b = family.fork(ws, 2)
    snap = ws.last_fork
    assert snap is not None
    files = [Path(snap.images), Path(snap.layer), *map(Path, snap.memfiles)]
    assert all(p.exists() for p in files)
    a.remove()
    assert Snapshot.get(snap.id, config=family.cfg) and all(p.exists() for p in files)
    b.remove()
    with pytest.raises(SnapshotNotFound):
        Snapshot.get(snap.id, config=family.cfg)
    assert not any(p.exists() for p in files)


def test_explicit_snapshot_lives_until_removed(family):
    ws = family.create()
    ws.files.write("/root/state", "v1\n")
    snap = family.snapshot(ws)
    (c,) = family.restore(snap, 1)
    c.remove()
    ws.remove()
    assert Snapshot.get(snap.id, config=family.cfg).record.keep
    (c2,) = family.restore(snap, 1)
    assert c2.files.read_text("/root/state") == "v1\n"
    snap.remove()  # still held by c2: its files stay until c2 goes
    assert Path(snap.record.layer).is_dir()
    assert c2.files.read_text("/root/state") == "v1\n"
    c2.remove()
    with pytest.raises(SnapshotNotFound):
        Snapshot.get(snap.id, config=family.cfg)
    assert not Path(snap.record.layer).exists()


def test_tree_shows_the_family(family):
    ws = family.create()
    clones = family.fork(ws, 2)
    kept = family.snapshot(clones[0])
    roots = build(family.cfg)
    (root,) = [r for r in roots if r.id == ws.id]
    assert isinstance(root, WorkspaceNode) and root.depth == 0 and root.memory is not None
    (fork_node,) = root.children
    assert isinstance(fork_node, SnapshotNode) and not fork_node.keep and fork_node.memfile_bytes > 0
    assert sorted(c.id for c in fork_node.children) == sorted(c.id for c in clones)
    c0 = next(c for c in fork_node.children if c.id == clones[0].id)
    assert c0.depth == 1 and c0.restore_ms and c0.memory and c0.memory.anon_bytes > 0
    assert [s.id for s in c0.children] == [kept.id] and c0.children[0].depth == 2


# ------------------------------------------------------------- save / load


def test_save_and_load_after_everything_was_removed(family, tmp_path):
    cfg = family.cfg
    ws = family.create()
    start_probe(ws)
    ws.files.write("/root/gen", "parent\n")
    (mid,) = family.fork(ws, 1)  # save a fork of a fork: two snapshot layers
    mid.files.write("/root/gen", "clone\n")
    expected = ask(mid, "write generation-2")
    snap = family.snapshot(mid)
    folder = snap.save(tmp_path / "saved")
    with pytest.raises(InvalidArgument):
        snap.save(folder)  # not empty
    for w in (mid, ws):
        w.remove()
    snap.remove()
    with Store.open(cfg.db_path) as store:
        gc.collect(cfg, store)
    assert leftovers(cfg) == {}
    loaded = Snapshot.load(folder, config=cfg)
    family.snapshots.append(loaded)
    assert loaded.id == snap.id and loaded.record.keep and loaded.record.depth == 2
    assert Snapshot.load(folder, config=cfg).id == loaded.id  # loading it again is a no-op
    clones = family.restore(loaded, 2)
    for c in clones:
        assert ask(c, "sum") == expected
        assert c.files.read_text("/root/gen") == "clone\n"
        assert c.exec(["cat", "/run/bunshin/fork-id"]).stdout.strip() == c.id
    assert ask(clones[0], "write diverged") != expected and ask(clones[1], "sum") == expected


def test_load_into_another_home(family, tmp_path):
    """A fresh home: unsigned for it (``trust``); agent and mask layers are its own, built there."""
    ws = family.create()
    expected = start_probe(ws)
    snap = family.snapshot(ws)
    folder = snap.save(tmp_path / "saved")
    other = Config.for_home(tmp_path / "home2", criu=family.cfg.criu)
    clones: list[Workspace] = []
    try:
        with pytest.raises(InvalidArgument, match="--trust"):
            Snapshot.load(folder, config=other)  # another home's key signed it
        loaded = Snapshot.load(folder, config=other, trust=True)
        assert all(str(other.tmpfs) in p for p in (loaded.record.layer, *loaded.record.lowers[:-1]))
        clones = loaded.restore(1)
        assert ask(clones[0], "sum") == expected
        assert clones[0].exec(["test", "-e", str(other.home)]).exit_code == 1  # hidden by its mask
        for c in clones:
            c.remove()
        loaded.remove()
        assert leftovers(other) == {}
    finally:
        for c in clones:
            with contextlib.suppress(WorkspaceNotFound):
                Workspace.get(c.id, config=other).remove()
        with contextlib.suppress(SnapshotNotFound):
            Snapshot.get(snap.id, config=other).remove()
        drop_state_tmpfs(other)


def test_load_rejects_what_is_not_a_saved_snapshot(no_leaks, tmp_path):
    with pytest.raises(InvalidArgument):
        Snapshot.load(tmp_path, config=no_leaks)
    for text in ('{"format": "something-else"}', '[1]', '{"format": "bunshin-snapshot/1", "record": {}}',
                 '{"format": "bunshin-snapshot/1", "record": {"id": "x"}, "layers": [], "memfiles": []}'):
        (tmp_path / "snapshot.json").write_text(text)
        with pytest.raises(InvalidArgument):
            Snapshot.load(tmp_path, config=no_leaks)


# --------------------------------------------------------------- failures


def test_bad_input_is_clear_and_leaves_the_parent_running(family):
    ws = family.create()
    before = start_probe(ws)
    with pytest.raises(InvalidArgument):
        ws.fork(0)
    with pytest.raises(InvalidArgument):
        ws.fork(-3)
    with pytest.raises(InvalidArgument, match="mode"):
        ws.fork(1, mode="lazy")
    with pytest.raises(InvalidArgument):
        ws.snapshot(mode="lazy")
    assert ws.is_alive() and ask(ws, "sum") == before
    gone = family.create()
    gone.remove()
    with pytest.raises(StateConflict):
        gone.fork(1)
    with pytest.raises(SnapshotNotFound):
        Snapshot.get("snap-doesnotexist", config=family.cfg)
    snap = family.snapshot(ws)
    with pytest.raises(InvalidArgument):
        snap.restore(0)
    assert ws.is_alive() and ask(ws, "sum") == before


WRAPPER = """#!/bin/sh
# a CRIU that fails on purpose: ACTION is dump or restore; restores from number FAIL_AT on
# fail; MODE=before fails without running CRIU, MODE=after runs it and then fails (a dump
# runs as `criu swrk FD`: CRIU's RPC mode)
ACTION={action}; FAIL_AT={fail_at}; MODE={mode}; DIR={dir}
if [ "$1" = "$ACTION" ] || {{ [ "$ACTION" = dump ] && [ "$1" = swrk ]; }}; then
    exec 9>"$DIR/lock"; flock 9
    n=$(( $(cat "$DIR/count" 2>/dev/null || echo 0) + 1 )); echo $n > "$DIR/count"
    exec 9>&-
    if [ $n -ge $FAIL_AT ]; then
        if [ "$MODE" = after ]; then {criu} "$@"; fi
        echo "injected failure of criu $ACTION number $n" >&2
        exit 1
    fi
fi
exec {criu} "$@"
"""


@pytest.mark.parametrize("action, fail_at, mode", [
    ("dump", 1, "before"),
    ("dump", 1, "after"),  # CRIU dumped (layer frozen, images written), then "failed"
    ("restore", 1, "before"),
    ("restore", 2, "before"),  # the first clone was restored: it is rolled back
    ("restore", 1, "after"),  # CRIU restored the tasks, then "failed": they are killed
])
def test_criu_failing_midway(family, tmp_path, action, fail_at, mode):
    cfg = family.cfg
    ws = family.create()
    before = start_probe(ws)
    wrapper = tmp_path / "criu"
    wrapper.write_text(WRAPPER.format(action=action, fail_at=fail_at, mode=mode, dir=tmp_path, criu=cfg.criu))
    wrapper.chmod(0o755)
    broken = Workspace.get(ws.id, config=dataclasses.replace(cfg, criu=wrapper))
    with pytest.raises(CriuError) as info:
        broken.fork(2)
    assert f"criu {action} failed" in info.value.message
    assert "injected failure" in info.value.log_tail or mode == "after"
    assert ws.is_alive() and ask(ws, "sum") == before
    assert [w.id for w in Workspace.list(config=cfg)] == [ws.id]
    with Store.open(cfg.db_path) as store:
        assert store.list_objects("snapshot") == []
    (ok,) = family.fork(ws, 1)  # the real CRIU still forks it
    assert ask(ok, "sum") == before


def test_sweep_frees_what_a_dead_owner_left_and_gc_takes_strays(family):
    cfg = family.cfg
    ws = family.create()
    dead = subprocess.Popen(["true"])
    dead.wait()
    with Store.open(cfg.db_path) as store:
        crashed_fork = rsnap_taking.take(cfg, store, ws.record, keep=False)  # its forker died before restoring
        half_kept = rsnap_taking.take(cfg, store, ws.record, keep=True)  # its maker died before finishing
        for snap in (crashed_fork, half_kept):
            store.put_object(rsnap_lifetime.KIND, snap.id, dataclasses.replace(snap, owner_pid=dead.pid).to_json())
        busy = rsnap_taking.take(cfg, store, ws.record, keep=False)  # owned by this live process
        kept = rsnap_taking.take(cfg, store, ws.record, keep=True)
        strays = [cfg.tmpfs / "layers" / "snap-stray", cfg.tmpfs / "snapshots" / "snap-stray"]
        for d in strays:
            d.mkdir(parents=True)
        stray_mem = rsnap_lifetime.mem_dir(cfg) / f"snap-stray-7{rsnap_taking.memfile.SUFFIX}"
        stray_mem.write_bytes(b"x")
        report = gc.collect(cfg, store)
        assert sorted(report.snapshots) == sorted([crashed_fork.id, half_kept.id])
        assert {str(p) for p in [*strays, stray_mem]} <= set(report.files)
        assert not any(p.exists() for p in [*strays, stray_mem])
        assert not Path(crashed_fork.images).exists() and not Path(half_kept.images).exists()
        assert all(Path(s.images).is_dir() for s in (busy, kept))  # recorded: gc keeps their images
        assert {i for i, _ in store.list_objects(rsnap_lifetime.KIND)} == {busy.id, kept.id}
        rsnap_lifetime.release(store, busy)
        assert rsnap_sweeping.sweep(cfg, store) == [busy.id]
        rsnap_sweeping.remove(cfg, store, kept)
    assert ws.is_alive()


@pytest.fixture(scope="module")
def busybox_root(tmp_path_factory) -> Path:
    """A minimal root filesystem: busybox only."""
    if not Path("/bin/busybox").exists():
        pytest.skip("busybox-static is not installed (make install installs it)")
    root = tmp_path_factory.mktemp("busybox-root")
    (root / "bin").mkdir()
    subprocess.run(["cp", "/bin/busybox", str(root / "bin" / "busybox")], check=True)
    for applet in ("sh", "cat", "echo", "sleep", "ps"):
        (root / "bin" / applet).symlink_to("busybox")
    for d in ("etc", "root", "tmp", "proc", "dev", "run"):
        (root / d).mkdir()
    return root


def test_fork_save_and_load_of_an_image_folder_workspace(family, busybox_root, tmp_path):
    ws = Workspace.create(str(busybox_root), config=family.cfg)
    family.workspaces.append(ws)
    ws.files.write("/root/f", "busybox\n")
    ws.commands.spawn(["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done"])
    wait_file(ws, "/tmp/count")
    for c in family.fork(ws, 2):
        assert c.exec(["cat", "/root/f", "/run/bunshin/fork-id"]).stdout == f"busybox\n{c.id}\n"
    snap = family.snapshot(ws)
    folder = snap.save(tmp_path / "saved")
    manifest = (folder / "snapshot.json").read_text()
    assert str(busybox_root) in manifest and '"role": "base"' in manifest
    family.close()
    loaded = Snapshot.load(folder, config=family.cfg)
    family.snapshots.append(loaded)
    assert loaded.record.lowers[-1] == str(busybox_root)
    (c,) = family.restore(loaded, 1)
    first = int(c.files.read_text("/tmp/count"))
    time.sleep(0.5)
    assert int(c.files.read_text("/tmp/count")) > first and c.files.read_text("/root/f") == "busybox\n"
