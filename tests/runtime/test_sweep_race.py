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
