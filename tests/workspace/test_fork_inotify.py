"""Integration: inotify watches survive a fork (issue 16), as every GLib app, IDE,
dev server and test watcher holds them.

The workspace's root overlay is mounted ``index=on,nfs_export=on``, so CRIU records
each watch by the path its file handle decodes to, and a clone's restore watches that
path in the clone's own overlay. The watcher is ``progs/watch.c``: one inotify
instance watching a file and a folder of the upper layer (made in the workspace) and
a file and a folder of the image's lower layer (/etc/hostname, /etc/default); in the
clones all four are in lower layers (the parent's upper frozen). Each clone must see
the changes made in it, and none made in its parent or sibling. A watch on /proc
cannot be recorded by CRIU (procfs decodes no handles): the fork is refused, naming
the process and the watch, and the workspace is left running as it was. A watch on a
folder shared from the host (a disk filesystem, which decodes handles) forks too, and so
does one on a deep image's files (its layers one read-only overlay below the root's,
mounted ``nfs_export=on`` too: ``idmap.stack``).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import NotForkable
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace
from tests.runtime import oci_images as oi
from tests.workspace.test_fork import wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"
LOG = "/tmp/watch.log"
WATCHED = ["/tmp/wf", "/tmp/wd", "/etc/hostname", "/etc/default"]


@pytest.fixture(scope="module")
def watcher(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("watch") / "watch"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(PROGS / "watch.c")], check=True)
    return out.read_bytes()


def start_watcher(ws: Workspace, binary: bytes, paths: list[str], log: str = LOG) -> int:
    """Start ``watch`` on ``paths`` in ``ws``; its pid inside once every watch is in place."""
    ws.files.write("/root/watch", binary, mode=0o755)
    ws.commands.spawn(["/root/watch", log, *paths])
    return int(wait_file(ws, f"{log}.ready", timeout=20))


def events_after(ws: Workspace, start: int) -> list[str]:
    """The watcher's log lines from line ``start`` on ("PATH MASK NAME")."""
    return ws.files.read_text(LOG).splitlines()[start:]


def wait_events(ws: Workspace, start: int, wanted: list[str], timeout: float = 20) -> list[str]:
    """Wait until every ``wanted`` "PATH NAME" pair is in the log after ``start``; the lines."""
    deadline = time.monotonic() + timeout
    while True:
        lines = events_after(ws, start)
        seen = {(ln.split()[0], ln.split()[-1]) for ln in lines if len(ln.split()) == 3}
        missing = [w for w in wanted if tuple(w.split()) not in seen]
        if not missing:
            return lines
        assert time.monotonic() < deadline, f"{ws.id}: no event for {missing}; log after the fork: {lines}"
        time.sleep(0.05)


def watches(ws: Workspace, pid: int) -> int:
    """How many watches the watcher's inotify descriptor holds (its fdinfo, read inside)."""
    out = ws.exec(["sh", "-c", f'for f in /proc/{pid}/fdinfo/*; do cat "$f"; done']).stdout
    return sum(1 for ln in out.splitlines() if ln.startswith("inotify wd:"))


def touch(ws: Workspace, *commands: str) -> None:
    r = ws.exec(["sh", "-c", " && ".join(commands)])
    assert r.exit_code == 0, r


def test_watches_on_upper_and_lower_files_fire_in_each_clone_for_its_own_changes(family, watcher):
    ws = family.create()
    touch(ws, "mkdir /tmp/wd", "echo start > /tmp/wf", "test -f /etc/hostname", "test -d /etc/default")
    pid = start_watcher(ws, watcher, WATCHED)
    touch(ws, "touch /tmp/wd/p0")
    wait_events(ws, 0, ["/tmp/wd p0"])  # the watcher works before the fork
    start = len(events_after(ws, 0))

    a, b = family.fork(ws, 2)
    for c in (a, b):
        assert watches(c, pid) == len(WATCHED), f"{c.id}: the watcher lost watches in the restore"
    touch(a, "echo a >> /tmp/wf", "touch /tmp/wd/a1", "echo a >> /etc/hostname", "touch /etc/default/a2")
    touch(b, "touch /tmp/wd/b1", "touch /etc/default/b2")
    touch(ws, "echo p >> /tmp/wf", "touch /tmp/wd/p1", "touch /etc/default/p2")
    wait_events(a, start, ["/tmp/wf -", "/tmp/wd a1", "/etc/hostname -", "/etc/default a2"])
    wait_events(b, start, ["/tmp/wd b1", "/etc/default b2"])
    wait_events(ws, start, ["/tmp/wf -", "/tmp/wd p1", "/etc/default p2"])
    time.sleep(0.3)  # time for a stray event to arrive
    for c, own in ((a, "a"), (b, "b"), (ws, "p")):
        names = [ln.split()[-1] for ln in events_after(c, start)]
        foreign = [n for n in names if n != "-" and not n.startswith(own)]
        assert not foreign, f"{c.id} saw another workspace's changes: {foreign}"
    assert not [ln for ln in events_after(b, start) if ln.startswith(("/tmp/wf ", "/etc/hostname "))], \
        "b changed neither watched file"
    # the watch carries on through a fork of a fork (its own upper frozen below it)
    start_a = len(events_after(a, 0))
    (aa,) = family.fork(a, 1)
    assert watches(aa, pid) == len(WATCHED)
    touch(aa, "touch /tmp/wd/aa1", "touch /etc/default/aa2", "echo aa >> /tmp/wf")
    wait_events(aa, start_a, ["/tmp/wd aa1", "/etc/default aa2", "/tmp/wf -"])
    time.sleep(0.3)
    assert not [ln for ln in events_after(a, start_a) if "aa" in ln.split()[-1]], "a saw its clone's changes"


def test_a_watch_criu_cannot_record_is_refused_naming_process_and_watch(family, watcher):
    ws = family.create()
    touch(ws, "mkdir /tmp/wd")
    pid = start_watcher(ws, watcher, ["/tmp/wd", "/proc"])
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 1)
    err = info.value
    assert f"process {pid}" in err.message and "/root/watch" in err.message, err.message
    assert "inotify watch" in err.message and "proc filesystem at /proc" in err.message, err.message
    assert err.hint and "stop the watcher" in err.hint
    assert err.details["process"] == pid and err.details["filesystem"] == "proc"
    # nothing was lost: the workspace runs on, its watcher with it
    touch(ws, "touch /tmp/wd/after")
    wait_events(ws, 0, ["/tmp/wd after"])
    # without the watcher the fork goes through
    touch(ws, f"kill {pid}", f"while [ -e /proc/{pid} ]; do sleep 0.02; done")  # ended and reaped
    (clone,) = family.fork(ws, 1)
    assert clone.exec("cat /tmp/watch.log").stdout == ws.exec("cat /tmp/watch.log").stdout


def test_a_watch_on_a_file_and_a_folder_deleted_before_the_fork_is_refused_before_the_freeze(family, watcher):
    """Deleted while a shell holds them (open files, working directory), the watches stay: CRIU has
    no path for them (for the image's file it would dump one that cannot be opened at the restore),
    the fork is refused by name and the workspace runs on; once the holder lets go the kernel drops
    them and the fork goes through, the remaining watch working in the clone and a fork of it."""
    ws = family.create()
    touch(ws, "mkdir /tmp/wd", "echo start > /tmp/wf", "echo keep > /tmp/keep")
    pid = start_watcher(ws, watcher, ["/tmp/wf", "/tmp/wd", "/etc/hostname", "/tmp/keep"])
    ws.commands.spawn(["sh", "-c", "cd /tmp/wd && exec 3</tmp/wf 4</etc/hostname && touch /tmp/held && exec sleep 600"])
    touch(ws, "while [ ! -e /tmp/held ]; do sleep 0.02; done")
    touch(ws, "rm /tmp/wf /etc/hostname", "rmdir /tmp/wd")
    assert watches(ws, pid) == 4
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 1)
    err = info.value
    assert f"process {pid} (/root/watch" in err.message, err.message
    assert "inotify watch (fd 3) on a deleted file or folder" in err.message, err.message
    assert "(and 2 more)" in err.message, err.message  # the folder and the image's file too
    assert "inotify_rm_watch" in (err.hint or "")
    with Store.open(family.cfg.db_path) as store:
        assert not rsnap.list_all(store)  # refused before anything was dumped
    touch(ws, "echo more >> /tmp/keep")
    wait_events(ws, 0, ["/tmp/keep -"])  # the watcher runs on
    touch(ws, "pkill -x sleep")
    deadline = time.monotonic() + 10
    while watches(ws, pid) != 1:  # the kernel dropped both watches with their inodes
        assert time.monotonic() < deadline, "the watches on the deleted file and folder stayed"
        time.sleep(0.05)
    (c,) = family.fork(ws, 1)
    (cc,) = family.fork(c, 1)
    for w in (c, cc):
        start = len(events_after(w, 0))
        touch(w, f"echo {w.id} >> /tmp/keep")
        wait_events(w, start, ["/tmp/keep -"])


def test_a_watch_on_a_shared_host_folder_fires_in_each_clone(family, watcher, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # root inside is an unprivileged host uid: it writes where all may
    ws = family.create(mounts=[f"{shared}:/data:rw"])
    start_watcher(ws, watcher, ["/data"])
    a, b = family.fork(ws, 2)
    for c in (a, b):
        assert watches(c, int(c.files.read_text(f"{LOG}.ready"))) == 1
    touch(a, "touch /data/a1")
    touch(b, "touch /data/b1")
    # the folder is shared on purpose: every watch on it sees every workspace's changes
    for c in (a, b, ws):
        wait_events(c, 0, ["/data a1", "/data b1"])
    assert sorted(p.name for p in shared.iterdir()) == ["a1", "b1"]


def test_a_watch_on_a_deep_images_files_fires_in_each_clone(watcher, tmp_path: Path, cfg: Config, no_leaks):
    layers = [oi.busybox_base()]
    layers += [oi.Layer(compress="none").add(f"l{i}", "dir").add("top", "file", f"{i}\n") for i in range(30)]
    oi.build_layout(tmp_path / "deep", layers)
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, tmp_path / "deep", tags=["test/deep-watch:1"])
    clones: list[Workspace] = []
    ws = None
    try:
        ws = Workspace.create("test/deep-watch:1", memory="256M", config=cfg)
        lowers = ws.exec("grep ' / / ' /proc/self/mountinfo").stdout
        assert "stack-" in lowers, f"the image's layers are not one stacked overlay: {lowers}"
        assert any(Path(m.mount_point).name.startswith("stack-") and "nfs_export=on" in m.super_options
                   for m in mountinfo.read()), "the stack decodes its file handles"
        # the watcher runs from the upper: a process running a file of a stacked layer does not
        # fork (CRIU: "Can't lookup mount=N for fd=-3", the stack's mount is not the workspace's)
        start_watcher(ws, watcher, ["/top", "/l0", "/l29"])
        clones = ws.fork(2)
        a, b = clones
        touch(a, "echo a >> /top", "touch /l0/a1")
        touch(b, "touch /l29/b1")
        wait_events(a, 0, ["/top -", "/l0 a1"])
        wait_events(b, 0, ["/l29 b1"])
        time.sleep(0.3)
        assert [ln for ln in events_after(b, 0) if not ln.endswith(" b1")] == [], "b saw a's changes"
        assert events_after(ws, 0) == [], "the parent saw its clones' changes"
    finally:
        for c in clones:
            c.remove()
        if ws is not None:
            ws.remove()
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)


@pytest.mark.skipif(shutil.which("gio") is None, reason="needs GLib's gio (libglib2.0-bin): run `make install`")
def test_glibs_file_monitor_follows_each_clone(family):
    """A program nobody here wrote: GLib's file monitor (``gio monitor``, what every GTK app
    uses), on inotify, reports in each clone the changes made in it. (GNU ``tail -f`` polls
    on an overlay, which coreutils counts as remote: no inotify to test there.)"""
    ws = family.create()
    touch(ws, "mkdir /tmp/d")
    ws.commands.spawn(["sh", "-c", "exec gio monitor /tmp/d > /tmp/gio.out 2>&1"])
    has_watch = "p=$(pidof gio) && ls -l /proc/$p/fd | grep -q inotify"
    deadline = time.monotonic() + 20
    while ws.exec(["sh", "-c", has_watch]).exit_code != 0:
        assert time.monotonic() < deadline, "gio never made its inotify watch"
        time.sleep(0.05)
    a, b = family.fork(ws, 2)
    touch(a, "touch /tmp/d/a1")
    touch(b, "touch /tmp/d/b1")
    for c, own, other in ((a, "a", "b"), (b, "b", "a")):
        deadline = time.monotonic() + 20
        while f"/tmp/d/{own}1: created" not in (out := c.files.read_text("/tmp/gio.out")):
            assert time.monotonic() < deadline, out
            time.sleep(0.05)
        time.sleep(0.3)
        assert f"{other}1" not in c.files.read_text("/tmp/gio.out"), "a sibling's change"
    assert ws.files.read_text("/tmp/gio.out") == "", "the parent saw its clones' changes"
