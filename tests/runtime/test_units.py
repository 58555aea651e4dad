"""Unit tests of runtime pieces that need no root: sizes, records, store, errors."""

from __future__ import annotations

import pytest

from bunshin.errors import (
    BunshinError,
    CriuError,
    InvalidArgument,
    PathNotFound,
    StateConflict,
    ToolTimeout,
    WorkspaceNotFound,
)
from bunshin.runtime.container.cgroups import parse_size
from bunshin.runtime.state.records import WorkspaceRecord, WorkspaceState
from bunshin.runtime.state.store import Store


@pytest.mark.parametrize(
    "text, expected",
    [("2G", 2 << 30), ("512M", 512 << 20), ("512MiB", 512 << 20), ("1.5g", 3 << 29), ("40000000", 40000000), ("65536k", 64 << 20)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "-1G", "0", "1X"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgument):
        parse_size(text)


def _rec(**kw) -> WorkspaceRecord:
    base = dict(id="ws-1", name=None, image="host", state=WorkspaceState.CREATING, created_at=1.0, root="/r",
                upper="/u", work="/w", lowers=("/l",), cgroup_version=1, cgroups=(("memory", "/m"),),
                memory_limit=1, pids_limit=8, hostname="h")
    base.update(kw)
    return WorkspaceRecord(**base)


def test_record_transitions():
    rec = _rec()
    running = rec.replace(state=WorkspaceState.RUNNING, pid=5)
    assert running.state is WorkspaceState.RUNNING
    removing = running.replace(state=WorkspaceState.REMOVING)
    with pytest.raises(StateConflict):
        removing.replace(state=WorkspaceState.RUNNING)
    assert WorkspaceRecord.from_json(running.to_json()) == running


def test_store_roundtrip_and_lookup(tmp_path):
    with Store.open(tmp_path / "s.db") as store:
        a = _rec(id="ws-aaa111", name="alpha")
        b = _rec(id="ws-aab222")
        store.add_workspace(a)
        store.add_workspace(b)
        assert store.get_workspace("alpha") == a
        assert store.get_workspace("ws-aab") == b
        with pytest.raises(InvalidArgument):
            store.get_workspace("ws-aa")  # ambiguous prefix
        with pytest.raises(InvalidArgument):
            store.add_workspace(_rec(id="ws-ccc", name="alpha"))  # duplicate name
        with pytest.raises(WorkspaceNotFound):
            store.get_workspace("nope")
        store.delete_workspace(a.id)
        assert [r.id for r in store.list_workspaces()] == [b.id]
    with Store.open(tmp_path / "s.db") as store:  # survives a reopen (another invocation)
        assert [r.id for r in store.list_workspaces()] == [b.id]


def test_errors_survive_the_wire_and_match_builtins():
    for err in [PathNotFound("x", hint="h", path="/x"), ToolTimeout("slow"), CriuError("boom", log_tail="tail")]:
        back = BunshinError.from_dict(err.to_dict())
        assert type(back) is type(err) and back.message == err.message and back.hint == err.hint
    assert isinstance(PathNotFound("x"), FileNotFoundError)
    assert isinstance(ToolTimeout("x"), TimeoutError)
    assert isinstance(InvalidArgument("x"), ValueError)
    assert "tail" in str(CriuError("boom", log_tail="tail"))


def test_cpu_nice_maps_to_the_schedulers_weights(tmp_path):
    from bunshin.runtime.container.cgroups import WorkspaceCgroup

    (tmp_path / "cpu.shares").write_text("1024")
    cg = WorkspaceCgroup(1, (("cpu", tmp_path),))
    cg.set_cpu_nice(19)
    assert (tmp_path / "cpu.shares").read_text() == "14"  # the kernel's weight for nice 19 is 15 of 1024
    cg.set_cpu_nice(0)
    assert (tmp_path / "cpu.shares").read_text() == "1024"
    with pytest.raises(InvalidArgument):
        cg.set_cpu_nice(-5)  # never above the default
