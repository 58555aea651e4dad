"""A clone's CPU cgroup weighed up while CRIU restores into it, and back to the default after
(``runtime/restore_boost``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.container.cgroups import Layout, WorkspaceCgroup
from bunshin.runtime.criu import restore_boost
from bunshin.runtime.criu import run as criu
from bunshin.runtime.state.records import SnapshotMode
from bunshin.runtime.state.store import Store


def test_the_factor_comes_from_the_environment_and_a_malformed_one_is_refused(monkeypatch):
    monkeypatch.delenv(restore_boost.ENV, raising=False)
    assert restore_boost.factor() == restore_boost.FACTOR
    for text, want in (("1", 1), ("0", 1), ("32", 32), ("", restore_boost.FACTOR)):
        monkeypatch.setenv(restore_boost.ENV, text)
        assert restore_boost.factor() == want
    for bad in ("x", "-2", "1.5"):
        monkeypatch.setenv(restore_boost.ENV, bad)
        with pytest.raises(InvalidArgument, match=restore_boost.ENV) as e:
            restore_boost.factor()
        assert "0 to restore at the default weight" in (e.value.hint or "")


def test_a_malformed_factor_is_refused_before_a_restore_makes_anything(monkeypatch, no_leaks, tmp_path):
    monkeypatch.setenv(restore_boost.ENV, "fast")
    snap = rsnap.SnapshotRecord(
        id="snap-000000000000", source="ws-x", image="host", mode=SnapshotMode.COW, keep=True, created_at=0.0,
        images=str(tmp_path / "images"), layer=str(tmp_path / "layer"), lowers=(), memfiles=(), memory_limit=None,
        pids_limit=None, hostname="x", depth=1, dump_ms=0, pause_ms=0, rewrite_ms=0, memfile_bytes=0, image_bytes=0,
        layer_bytes=0)
    with Store.open(no_leaks.db_path) as store:
        with pytest.raises(InvalidArgument, match=restore_boost.ENV):
            rsnap.restore(no_leaks, store, snap, 2)
        assert store.list_workspaces() == []


@pytest.fixture
def cpu_cgroup():
    layout = Layout.discover()
    cg = WorkspaceCgroup.create(layout, f"bunshin-test-boost-{os.getpid()}", memory=None, pids=None)
    if restore_boost._weight_file(cg) is None:
        cg.destroy()
        pytest.skip("no CPU controller in this host's workspace cgroups")
    yield cg
    cg.destroy()


@pytest.mark.integration
def test_boost_weighs_the_cgroup_up_and_settle_puts_the_default_back(cpu_cgroup):
    f = restore_boost._weight_file(cpu_cgroup)
    assert f is not None
    default = restore_boost.DEFAULT[cpu_cgroup.version]
    assert int(f.read_text()) == default
    assert restore_boost.boost(cpu_cgroup, 1) is False and int(f.read_text()) == default  # off: untouched
    assert restore_boost.boost(cpu_cgroup, 8) is True and int(f.read_text()) == 8 * default
    restore_boost.settle(cpu_cgroup)
    assert int(f.read_text()) == default
    assert restore_boost.boost(cpu_cgroup, 10**6) is True  # capped at the kernel's largest weight
    assert int(f.read_text()) == restore_boost._MAX[cpu_cgroup.version]
    restore_boost.settle(cpu_cgroup)
    cpu_cgroup.destroy()
    restore_boost.settle(cpu_cgroup)  # gone (a failed restore removed it): nothing to do, no error


def _weights_seen_by_criu(monkeypatch) -> list[int]:
    """Record the CPU weight of the cgroups each restore's criu joins, when criu is asked."""
    seen: list[int] = []
    real = criu.restore

    def watching(*args, **kw):
        for procs in kw["placement"].cgroup_procs:
            for name in restore_boost.FILE.values():
                f = Path(procs).parent / name
                if f.exists():
                    seen.append(int(f.read_text()))
        return real(*args, **kw)

    monkeypatch.setattr(criu, "restore", watching)
    return seen


@pytest.mark.criu
@pytest.mark.parametrize("factor", ["8", "1"])
def test_criu_restores_into_a_weighed_up_cgroup_and_the_clone_keeps_the_default(family, monkeypatch, factor):
    monkeypatch.setenv(restore_boost.ENV, factor)
    ws = family.create()
    ws.exec(["sh", "-c", "sleep 1000 &"])
    seen = _weights_seen_by_criu(monkeypatch)
    clones = family.fork(ws, 2)
    cg = WorkspaceCgroup.of_record(clones[0].record)
    f = restore_boost._weight_file(cg)
    if f is None:
        pytest.skip("no CPU controller in this host's workspace cgroups")
    default = restore_boost.DEFAULT[cg.version]
    assert seen == [default * int(factor)] * 2  # both restores, before criu joined
    for clone in clones:
        w = restore_boost._weight_file(WorkspaceCgroup.of_record(clone.record))
        assert w is not None and int(w.read_text()) == default
        assert clone.exec(["true"]).exit_code == 0


def test_in_thread_runs_at_the_restore_nice_value_and_gives_the_thread_its_own_back():
    import threading

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: list[int] = []

    def body() -> None:
        before = nice()
        seen.append(restore_boost.in_thread(nice))
        seen.append(nice() - before)  # back to its own value
        with pytest.raises(ZeroDivisionError):  # a restore that fails gives it back too
            restore_boost.in_thread(lambda: 1 // 0)
        seen.append(nice() - before)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [restore_boost.THREAD_NICE, 0, 0]
