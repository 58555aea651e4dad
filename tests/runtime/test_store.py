"""The store's read-modify-write: inside one BEGIN IMMEDIATE transaction, two writers with
their own connections (as two bunshin processes have) never lose each other's update."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.state.records import WorkspaceRecord, WorkspaceState
from bunshin.runtime.state.store import Store

ROUNDS = 40


def _increment(data: str) -> str:
    time.sleep(0.001)  # between the read and the write: the other writer gets its turn here
    return json.dumps({"n": json.loads(data)["n"] + 1})


def _race(db: Path, one_round: Callable[[Store], None]) -> None:
    """Two threads, each with its own connection, doing ``ROUNDS`` rounds at once."""
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with Store.open(db) as store:
                start.wait()
                for _ in range(ROUNDS):
                    one_round(store)
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_two_writers_lose_no_update(tmp_path):
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        store.put_object("counter", "c", json.dumps({"n": 0}))
    _race(db, lambda s: s.update_object("counter", "c", _increment))
    with Store.open(db) as store:
        assert json.loads(store.get_object("counter", "c") or "")["n"] == 2 * ROUNDS


def test_without_the_transaction_the_same_race_loses_updates(tmp_path):
    """The race above is real: read, change and write back without it, and updates are lost."""
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        store.put_object("counter", "c", json.dumps({"n": 0}))

    def unsafe(s: Store) -> None:
        s.put_object("counter", "c", _increment(s.get_object("counter", "c") or ""))

    _race(db, unsafe)
    with Store.open(db) as store:
        assert json.loads(store.get_object("counter", "c") or "")["n"] < 2 * ROUNDS


def _snap(snap_id: str) -> rsnap.SnapshotRecord:
    return rsnap.SnapshotRecord(
        id=snap_id, source="ws-1", image="host", mode="cow", keep=True, created_at=1.0,
        images="/i", layer="/l", lowers=(), memfiles=(), memory_limit=None, pids_limit=None, hostname="h",
        depth=1, dump_ms=0, pause_ms=0, rewrite_ms=0, memfile_bytes=0, image_bytes=0, layer_bytes=0, owner_pid=7,
    )


def test_concurrent_changes_to_different_fields_of_a_snapshot_are_both_kept(tmp_path):
    """``release`` (owner) in one process and ``remove`` (keep) in another: neither undoes the other."""
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        for i in range(ROUNDS):
            store.put_object(rsnap.KIND, f"snap-{i}", _snap(f"snap-{i}").to_json())
    ids = iter(range(2 * ROUNDS))
    lock = threading.Lock()

    def one_round(store: Store) -> None:
        with lock:
            k = next(ids)
        i, field = k // 2, ("owner_pid", None) if k % 2 else ("keep", False)
        rsnap.update(store, f"snap-{i}", **{field[0]: field[1]})

    _race(db, one_round)
    with Store.open(db) as store:
        assert all(s.owner_pid is None and s.keep is False for s in rsnap.list_all(store))
        assert rsnap.update(store, "snap-none", keep=False) is None


def _ws(ws_id: str) -> WorkspaceRecord:
    return WorkspaceRecord(id=ws_id, name=None, image="host", state=WorkspaceState.CREATING, created_at=1.0,
                           root="/r", upper="/u", work="/w", lowers=(), cgroup_version=2, cgroups=(),
                           memory_limit=None, pids_limit=None, hostname="h")


def test_update_workspace_checks_the_stored_state(tmp_path):
    with Store.open(tmp_path / "state.db") as store:
        store.add_workspace(_ws("ws-1"))
        got = store.update_workspace("ws-1", lambda r: r.replace(state=WorkspaceState.REMOVING))
        assert got is not None and store.get_workspace("ws-1").state == WorkspaceState.REMOVING
        # a stale copy cannot bring it back: the transition is checked against what is stored
        from bunshin.errors import StateConflict
        with pytest.raises(StateConflict):
            store.update_workspace("ws-1", lambda r: r.replace(state=WorkspaceState.RUNNING))
        assert store.update_workspace("ws-none", lambda r: r) is None


def test_a_transaction_rolls_back_and_nests(tmp_path):
    with Store.open(tmp_path / "state.db") as store:
        with pytest.raises(KeyError), store.transaction():
            store.put_object("k", "a", "1")
            with store.transaction():  # joins the outer one
                store.put_object("k", "b", "2")
            raise KeyError("boom")
        assert store.list_objects("k") == []
        with store.transaction():
            store.put_object("k", "a", "1")
            with store.transaction():
                store.put_object("k", "b", "2")
        assert store.list_objects("k") == [("a", "1"), ("b", "2")]


# --- connections kept for the next open --------------------------------------------------


def test_a_kept_connection_is_reused_and_sees_other_processes_writes(tmp_path):
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        first = store._conn
        store.put_object("t", "a", "1")
    with Store.open(db) as store:
        assert store._conn is first  # kept, not opened anew
        # another process writes meanwhile: the kept connection reads it
        code = ("import sys; from pathlib import Path; from bunshin.runtime.state.store import Store\n"
                "with Store.open(Path(sys.argv[1])) as s: s.put_object('t', 'a', '2')\n")
        subprocess.run([sys.executable, "-c", code, str(db)], check=True, timeout=60)
        assert store.get_object("t", "a") == "2"
    closed = Store.open(db)
    closed.close()
    with pytest.raises(sqlite3.ProgrammingError):  # a closed store stays closed, its connection kept elsewhere
        closed.get_object("t", "a")


def test_a_database_made_anew_at_the_path_gets_new_connections(tmp_path):
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        store.put_object("t", "a", "old")
    for f in tmp_path.iterdir():  # the home removed and made again, as a test or a user does
        f.unlink()
    with Store.open(db) as store:
        assert store.get_object("t", "a") is None  # the new file, not the removed one's kept connection
        store.put_object("t", "a", "new")
    with Store.open(db) as store:
        assert store.get_object("t", "a") == "new"


def test_a_forked_child_never_uses_the_parents_kept_connections(tmp_path):
    db = tmp_path / "state.db"
    with Store.open(db) as store:
        store.put_object("t", "a", "1")
        parents = store._conn
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: plain writes, then _exit
        ok = 0
        try:
            with Store.open(db) as store:
                ok = int(store._conn is not parents and store.get_object("t", "a") == "1")
                store.put_object("t", "a", "child")
        finally:
            os.write(w, str(ok).encode())
            os._exit(0)
    os.close(w)
    answer = os.read(r, 8)
    os.close(r)
    os.waitpid(pid, 0)
    assert answer == b"1"
    with Store.open(db) as store:
        assert store._conn is parents and store.get_object("t", "a") == "child"


def test_connections_kept_are_bounded_per_file_and_in_all(tmp_path):
    from bunshin.runtime.state import store as store_mod

    homes = [tmp_path / f"h{i}" / "state.db" for i in range(store_mod.IDLE_MAX + 4)]
    for db in homes:  # each file: more stores open at once than are kept for it
        stores = [Store.open(db) for _ in range(store_mod.IDLE_PER_FILE + 2)]
        conns = [s._conn for s in stores]
        for s in stores:
            s.close()
        assert sum(c in conns for c in store_mod._idle._by_file.get(store_mod._file_key(db), [])) == store_mod.IDLE_PER_FILE
        with pytest.raises(sqlite3.ProgrammingError):  # one past the file's bound was closed
            conns[-1].execute("SELECT 1")
    kept = store_mod._idle._by_file
    assert sum(len(v) for v in kept.values()) <= store_mod.IDLE_MAX
    assert store_mod._file_key(homes[0]) not in kept  # the file used longest ago went first
    assert store_mod._file_key(homes[-1]) in kept


def test_kept_connections_are_released_so_their_file_system_can_be_unmounted(tmp_path):
    """A kept connection holds its database open, so the file system under it is busy until
    ``release_kept`` closes it."""
    from bunshin.runtime.state.store import release_kept

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "bunshin-test-store", str(mnt)], check=True)
    try:
        with Store.open(mnt / "state.db") as store:
            store.put_object("k", "1", "x")
        busy = subprocess.run(["umount", str(mnt)], capture_output=True, text=True)
        assert busy.returncode != 0 and "busy" in busy.stderr, busy
        assert release_kept(mnt / "state.db") >= 1 and release_kept(mnt / "state.db") == 0
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_live_limits_and_kept_snapshot_bytes_are_summed_in_sql(tmp_path):
    """What the server's caps read at each create: the limits of the workspaces not dead and not
    made ahead of their restore, and the bytes kept snapshots hold; a field name is never SQL."""
    import dataclasses

    from bunshin.runtime.state.records import MADE_AHEAD

    with Store.open(tmp_path / "state.db") as store:
        store.add_workspace(dataclasses.replace(_ws("ws-a"), memory_limit=1 << 30, pids_limit=64))
        store.add_workspace(dataclasses.replace(_ws("ws-b"), memory_limit=None, pids_limit=None))
        store.add_workspace(dataclasses.replace(_ws("ws-c"), memory_limit=7, state=WorkspaceState.DEAD))
        store.add_workspace(dataclasses.replace(_ws("ws-d"), memory_limit=9, extra={MADE_AHEAD: True}))
        assert sorted(store.live_limits(), key=str) == sorted([(1 << 30, 64), (None, None)], key=str)
        snap = {"memfile_bytes": 100, "image_bytes": 20, "layer_bytes": 3}
        store.put_object(rsnap.KIND, "snap-kept", json.dumps({**snap, "keep": True}))
        store.put_object(rsnap.KIND, "snap-fork", json.dumps({**snap, "keep": False}))
        assert rsnap.kept_bytes(store) == 123
        with pytest.raises(ValueError, match="not field names"):
            store.sum_objects(rsnap.KIND, ("x') OR 1=1 --",), where="keep")
