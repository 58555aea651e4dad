"""Integration: the next clone of a snapshot made ahead (``Snapshot.restore(ahead=True)``,
``runtime.snapshot.ahead``): made up to its criu run in the background, left out of lists,
taken by the next restore of one (which then runs only criu and what follows), and
destroyed whole when released, when its snapshot goes, when a restore refuses it, or by
gc once the process that made it is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bunshin.errors import CriuError, InvalidArgument
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.criu import run as criu_run
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Snapshot, Workspace
from tests.conftest import leftovers

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _ahead_records(cfg) -> list:
    with Store.open(cfg.db_path) as store:
        return [r for r in store.list_workspaces() if r.extra.get(rsnap.MADE_AHEAD)]


def _made_ahead(cfg, snap: Snapshot):
    """Wait for the clone being made ahead of ``snap``; its record."""
    rsnap.ahead.wait()
    (rec,) = _ahead_records(cfg)
    assert rec.snapshot == snap.id and rec.state.value == "creating"
    return rec


def test_the_next_clone_is_made_ahead_and_taken_by_the_next_restore(family):
    ws = family.create()
    ws.files.write("/tmp/mark", "parent\n")
    snap = family.snapshot(ws)
    (first,) = snap.restore(1, ahead=True)
    family.workspaces.append(first)
    ready = _made_ahead(family.cfg, snap)
    # not a workspace yet: no process, left out of lists
    assert ready.pid is None
    assert ready.id not in {i.id for i in Workspace.list(config=family.cfg)}

    (second,) = snap.restore(1, ahead=True)
    family.workspaces.append(second)
    assert second.id == ready.id  # the clone made ahead, now restored
    with Store.open(family.cfg.db_path) as store:
        rec = store.get_workspace(second.id)
    assert not rec.extra.get(rsnap.MADE_AHEAD) and rec.owner_pid is None and rec.state.value == "running"
    steps = rec.extra["restore_steps_ms"]
    assert steps["ahead"] > 0 and steps["prepare"] < steps["ahead"]  # made before, off the restore's path
    assert second.files.read("/tmp/mark") == b"parent\n"
    second.files.write("/tmp/mark", "second\n")
    assert first.files.read("/tmp/mark") == b"parent\n"  # each its own
    assert second.commands.run("cat /proc/self/status").ok

    third = _made_ahead(family.cfg, snap)  # and the next one
    assert third.id not in (first.id, second.id)
    rsnap.ahead.release(snap.id)
    assert _ahead_records(family.cfg) == []
    assert not family.cfg.paths.workspace(third.id).exists()


def test_removing_the_snapshot_destroys_its_clone_made_ahead(family):
    ws = family.create()
    snap = family.snapshot(ws)
    (clone,) = snap.restore(1, ahead=True)
    clone.remove()
    ready = _made_ahead(family.cfg, snap)
    snap.remove()
    family.snapshots.remove(snap)
    assert _ahead_records(family.cfg) == []
    assert not family.cfg.paths.workspace(ready.id).exists()
    with Store.open(family.cfg.db_path) as store:
        assert snap.id not in [s.id for s in rsnap.list_all(store)]  # nothing holds it now


def test_a_restore_that_cannot_take_it_destroys_it_and_makes_nothing(family):
    ws = family.create()
    snap = family.snapshot(ws)
    family.workspaces += snap.restore(1, ahead=True)
    _made_ahead(family.cfg, snap)
    ready = rsnap.ahead.take(snap.id)
    assert ready is not None
    before = {i.id for i in Workspace.list(config=family.cfg)}
    with Store.open(family.cfg.db_path) as store, pytest.raises(InvalidArgument, match="made ahead"):
        rsnap.restore(family.cfg, store, snap.record, 2, ready=ready)
    assert {i.id for i in Workspace.list(config=family.cfg)} == before
    assert _ahead_records(family.cfg) == [] and not family.cfg.paths.workspace(ready.rec.id).exists()
    rsnap.ahead.release(snap.id)


def test_a_failed_restore_of_a_clone_made_ahead_leaves_nothing(family, monkeypatch):
    ws = family.create()
    snap = family.snapshot(ws)
    family.workspaces += snap.restore(1, ahead=True)
    ready_id = _made_ahead(family.cfg, snap).id

    def broken(*_a, **_k):
        raise CriuError("criu restore failed (staged by the test)", action="restore")

    monkeypatch.setattr(criu_run, "restore", broken)
    with pytest.raises(CriuError, match="staged"):
        snap.restore(1, ahead=True)
    monkeypatch.undo()
    rsnap.ahead.wait()  # the failed restore still asked for the next
    rsnap.ahead.release(snap.id)
    assert _ahead_records(family.cfg) == []
    assert not family.cfg.paths.workspace(ready_id).exists()
    images = snap.record.images
    assert not [p for p in os.listdir(images) if p.startswith(".clone-")]


def test_gc_removes_a_clone_made_ahead_by_a_process_that_died(family):
    ws = family.create()
    snap = family.snapshot(ws)
    home, criu = family.cfg.home, family.cfg.criu
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from bunshin.config import Config
        from bunshin.runtime import snapshot as rsnap
        from bunshin.workspace import Snapshot
        cfg = Config.for_home(Path({str(home)!r}), criu=Path({str(criu)!r}))
        rsnap.ahead.want(cfg, Snapshot.get({snap.id!r}, config=cfg).record)
        rsnap.ahead.wait()
        os._exit(0)  # as if killed: nothing released
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=str(family.cfg.home))
    (orphan,) = _ahead_records(family.cfg)
    assert family.cfg.paths.workspace(orphan.id).exists()
    with Store.open(family.cfg.db_path) as store:
        gc.collect(family.cfg, store)
    assert _ahead_records(family.cfg) == []
    assert not family.cfg.paths.workspace(orphan.id).exists()
    assert leftovers(family.cfg)["records"] == [ws.id]  # the family's own workspace only


def test_a_forked_child_neither_takes_nor_destroys_its_parents_clone_made_ahead(family):
    ws = family.create()
    snap = family.snapshot(ws)
    family.workspaces += snap.restore(1, ahead=True)
    ready = _made_ahead(family.cfg, snap)
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's to take, and its exit releases nothing
        code = 0 if rsnap.ahead.take(snap.id) is None else 3
        rsnap.ahead.release()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    (still,) = _ahead_records(family.cfg)
    assert still.id == ready.id and family.cfg.paths.workspace(ready.id).exists()
    rsnap.ahead.release(snap.id)
