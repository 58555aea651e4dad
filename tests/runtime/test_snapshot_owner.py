"""``sweep`` and a snapshot's owner: a live maker holds it, a finished or dead one does not."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time

from bunshin.config import Config
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.state.store import Store


def _owned(cfg: Config, snap_id: str, owner_pid: int) -> rsnap.SnapshotRecord:
    """A fork's snapshot (not kept) as ``take`` records it, with its folder and layer."""
    snap = rsnap.SnapshotRecord(
        id=snap_id, source="ws-x", image="host", mode="cow", keep=False, created_at=time.time(),
        images=str(cfg.paths.snapshot(snap_id) / "images"), layer=str(cfg.paths.layer(snap_id)),
        lowers=("/",), memfiles=(), memory_limit=None, pids_limit=None, hostname="h", depth=1, dump_ms=0,
        pause_ms=0, rewrite_ms=0, memfile_bytes=0, image_bytes=0, layer_bytes=0, owner_pid=owner_pid,
    )
    images = cfg.paths.snapshot(snap_id) / "images"
    images.mkdir(parents=True)
    cfg.paths.layer(snap_id).mkdir(parents=True)
    return snap


def _ids(store: Store) -> list[str]:
    return [s.id for s in rsnap.list_all(store)]


def test_a_snapshot_this_process_owns_but_no_longer_makes_is_freed(tmp_path):
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    with Store.open(cfg.db_path) as store:
        snap = _owned(cfg, "snap-000000000001", os.getpid())
        store.put_object(rsnap.KIND, snap.id, snap.to_json())  # a path that missed `release`
        assert rsnap.sweep(cfg, store) == [snap.id]
        assert _ids(store) == []
        assert not cfg.paths.snapshot(snap.id).exists() and not cfg.paths.layer(snap.id).exists()


def test_a_snapshot_being_made_here_is_held_by_every_claim_until_the_last_goes(tmp_path):
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    with Store.open(cfg.db_path) as store:
        snap = _owned(cfg, "snap-000000000002", os.getpid())
        rsnap.claim(snap.id)
        rsnap.claim(snap.id)  # two threads loading the same snapshot
        try:
            store.put_object(rsnap.KIND, snap.id, snap.to_json())
            assert rsnap.sweep(cfg, store) == [] and _ids(store) == [snap.id]
            rsnap.unclaim(snap.id)
            assert rsnap.sweep(cfg, store) == [] and _ids(store) == [snap.id]
        finally:
            rsnap.unclaim(snap.id)
        assert rsnap.sweep(cfg, store) == [snap.id] and _ids(store) == []


def test_a_snapshot_another_live_process_makes_is_held_until_it_dies(tmp_path):
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    maker = subprocess.Popen(["sleep", "60"])
    try:
        with Store.open(cfg.db_path) as store:
            snap = _owned(cfg, "snap-000000000003", maker.pid)
            store.put_object(rsnap.KIND, snap.id, snap.to_json())
            assert rsnap.sweep(cfg, store) == [] and _ids(store) == [snap.id]
            maker.kill()
            maker.wait()
            assert rsnap.sweep(cfg, store) == [snap.id] and _ids(store) == []
    finally:
        maker.kill()
        maker.wait()


def test_a_kept_snapshot_outlives_its_maker(tmp_path):
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    with Store.open(cfg.db_path) as store:
        snap = dataclasses.replace(_owned(cfg, "snap-000000000004", os.getpid()), keep=True, owner_pid=None)
        store.put_object(rsnap.KIND, snap.id, snap.to_json())
        assert rsnap.sweep(cfg, store) == [] and _ids(store) == [snap.id]
