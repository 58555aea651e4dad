"""Integration: ``remove_all`` removes many workspaces at once and leaves nothing behind."""

from __future__ import annotations

import psutil
import pytest

from bunshin.errors import WorkspaceNotFound
from bunshin.runtime.container import teardown
from bunshin.runtime.container.cgroups import WorkspaceCgroup
from bunshin.runtime.state.store import Store
from bunshin.workspace import Workspace
from bunshin.workspace.batch import remove_all

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_remove_all_takes_every_clone_and_every_process_they_started(no_leaks):
    root = Workspace.create("host", memory="256M", pids=128, config=no_leaks)
    clones: list[Workspace] = []
    try:
        # each clone starts 20 more processes that ignore SIGTERM and hang up
        for c in (clones := root.fork(4)):
            c.exec("for i in $(seq 20); do (trap '' TERM HUP; exec sleep 1000) & done", timeout=30)
        host = [(pid, psutil.Process(pid).create_time()) for c in clones
                for pid in WorkspaceCgroup.of_record(c.record).pids()]
        assert len(host) >= 4 * 20
        remove_all([*clones, root])
    except BaseException:
        for w in (*clones, root):
            w.remove()
        raise
    assert not [pid for pid, t in host if _same_process_alive(pid, t)]
    for w in (*clones, root):
        with pytest.raises(WorkspaceNotFound):
            Workspace.get(w.id, config=no_leaks)
    # nothing of them in the store, the tmpfs, the mounts or the cgroups: checked by no_leaks


def _same_process_alive(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_remove_all_of_a_half_made_workspace_and_twice_is_harmless(no_leaks):
    ws = Workspace.create("host", memory="64M", pids=32, config=no_leaks)
    rec = ws.record
    teardown.umount_all(rec.root)  # half torn down already: its root unmounted
    remove_all([ws])
    remove_all([ws])  # its record is gone: nothing to do, no error
    remove_all([])
    with Store.open(no_leaks.db_path) as store:
        assert rec.id not in {r.id for r in store.list_workspaces()}


def test_umount_all_of_a_folder_that_is_no_mount_point_does_nothing(tmp_path):
    (tmp_path / "d").mkdir()
    teardown.umount_all(str(tmp_path / "d"))
    teardown.umount_all(str(tmp_path / "missing"))
    assert (tmp_path / "d").is_dir()
