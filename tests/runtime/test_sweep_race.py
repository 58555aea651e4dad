"""``sweep`` must never delete the files of a snapshot that is being taken concurrently."""

from __future__ import annotations

import time

from bunshin.config import Config
from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
from bunshin.runtime.snapshot import sweeping as rsnap_sweeping
from bunshin.runtime.state.store import Store


def _record(cfg: Config, snap_id: str) -> rsnap_lifetime.SnapshotRecord:
    return rsnap_lifetime.SnapshotRecord(
        id=snap_id, source="ws-x", image="host", mode="cow", keep=True, created_at=time.time(),
        images=str(cfg.tmpfs / "snapshots" / snap_id / "images"), layer=str(cfg.tmpfs / "layers" / snap_id),
        lowers=("/",), memfiles=(), memory_limit=None, pids_limit=None, hostname="h", depth=1, dump_ms=0,
        pause_ms=0, rewrite_ms=0, memfile_bytes=0, image_bytes=0, layer_bytes=0,
    )


def test_snapshot_created_while_sweeping_survives(tmp_path, monkeypatch):
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    with Store.open(cfg.db_path) as store:
        stray = cfg.tmpfs / "snapshots" / "snap-stray"
        stray.mkdir(parents=True)
        real_list_all = rsnap_lifetime.list_all
        made = []

        def list_all_while_a_snapshot_is_taken(st: Store) -> list[rsnap_lifetime.SnapshotRecord]:
            # The sweep has just read the records; right now another process records a
            # snapshot and creates its folder (record first, then files, as take() does).
            seen = real_list_all(st)
            if not made:
                snap = _record(cfg, "snap-new")
                st.put_object(rsnap_lifetime.KIND, snap.id, snap.to_json())
                (cfg.tmpfs / "snapshots" / "snap-new" / "images").mkdir(parents=True)
                made.append(snap)
            return seen

        monkeypatch.setattr(rsnap_lifetime, "list_all", list_all_while_a_snapshot_is_taken)
        monkeypatch.setattr(rsnap_sweeping, "list_all", list_all_while_a_snapshot_is_taken)
        rsnap_sweeping._sweep_orphans(cfg, store)
        assert (cfg.tmpfs / "snapshots" / "snap-new" / "images").is_dir(), "a snapshot being taken was deleted"
        assert not stray.exists(), "a folder no record names must go"


def test_a_clone_folder_made_while_sweeping_survives(tmp_path, monkeypatch):
    """A restore records its clone, then makes the clone's images folder (``clone_images``);
    a sweep that read the live workspaces just before must not take that folder for the
    leftover of a dead restore (a fork once failed with ".clone-ws-...: No such file")."""
    from bunshin.runtime.criu import clone_images

    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    with Store.open(cfg.db_path) as store:
        snap = _record(cfg, "snap-kept")
        store.put_object(rsnap_lifetime.KIND, snap.id, snap.to_json())
        images = cfg.tmpfs / "snapshots" / snap.id / "images"
        (images / f"{clone_images.CLONE_PREFIX}ws-dead").mkdir(parents=True)
        restoring = images / f"{clone_images.CLONE_PREFIX}ws-new"
        real = store.list_workspaces
        reads: list[int] = []

        def live_then_a_restore_starts():
            """The sweep's second read is the live workspaces': ws-new is recorded and its
            folder made right after it (the first is ``held_layers``')."""
            seen = real()
            reads.append(1)
            if len(reads) == 2:
                restoring.mkdir()
            return seen

        monkeypatch.setattr(store, "list_workspaces", live_then_a_restore_starts)
        freed = rsnap_sweeping._sweep_orphans(cfg, store)
        assert restoring.is_dir(), "the images folder of a restore under way was deleted"
        assert freed == [str(images / f"{clone_images.CLONE_PREFIX}ws-dead")]
        assert not (images / f"{clone_images.CLONE_PREFIX}ws-dead").exists()
