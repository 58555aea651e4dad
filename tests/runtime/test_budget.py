"""The host-wide pids budget: creates, forks and restores that would pass it are refused with
nothing made, also when two callers race for the last room; out-of-range limits are bad input."""

from __future__ import annotations

import threading

import pytest

from bunshin.errors import BunshinError, InvalidArgument, ResourceExhausted
from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
from bunshin.runtime.snapshot import restoring as rsnap_restoring
from bunshin.runtime.state import budget
from bunshin.runtime.state.store import Store
from bunshin.workspace import Workspace


@pytest.mark.parametrize("bad", [10**12, 7, 0, -1, True, 1.5, "512"])
def test_a_pids_limit_out_of_range_is_bad_input(bad):
    with pytest.raises(InvalidArgument) as e:
        budget.check_pids_limit(bad)
    assert "pids limit" in e.value.message and e.value.hint


def test_the_budget_is_pid_max_less_the_margin(monkeypatch):
    monkeypatch.setattr(budget, "pid_max", lambda: 2000)
    assert budget.pids_budget() == 1800
    assert budget.check_pids_limit(1800) == 1800 and budget.check_pids_limit(None) is None
    with pytest.raises(InvalidArgument, match="kernel.pid_max 2000"):
        budget.check_pids_limit(1801)




def _records(cfg):
    with Store.open(cfg.db_path) as store:
        return [r.id for r in store.list_workspaces()], [s.id for s in rsnap_lifetime.list_all(store)]


@pytest.mark.integration
@pytest.mark.criu
def test_creates_forks_and_restores_past_the_budget_are_refused_with_nothing_made(no_leaks, monkeypatch):
    monkeypatch.setattr(budget, "pid_max", lambda: 2000)  # a budget of 1800 pids
    monkeypatch.setattr(rsnap_restoring, "_tasks_now", lambda: 0)  # the machine's own tasks: not what is tested here
    with Workspace.create("host", memory="256M", pids=1000, config=no_leaks) as ws:
        with pytest.raises(ResourceExhausted, match="pids budget") as e:
            Workspace.create("host", memory="256M", pids=1000, config=no_leaks)
        assert e.value.details["taken"] == 1000 and "at most 800" in e.value.hint
        assert _records(no_leaks) == ([ws.id], [])
        with pytest.raises(ResourceExhausted, match="pids budget"):
            ws.fork(1)  # refused before the dump: no snapshot either
        assert _records(no_leaks) == ([ws.id], [])
        snap = ws.snapshot()
        try:
            with pytest.raises(ResourceExhausted, match="pids budget"):
                snap.restore(1)
            assert _records(no_leaks) == ([ws.id], [snap.id])
        finally:
            snap.remove()
        with Workspace.create("host", memory="256M", pids=800, config=no_leaks) as fits:
            assert fits.exec("true").ok
        with pytest.raises(ResourceExhausted, match="no pids limit"):
            Workspace.create("host", memory="256M", pids=None, config=no_leaks)
    assert _records(no_leaks) == ([], [])


@pytest.mark.integration
@pytest.mark.criu
def test_two_creates_racing_for_the_last_room_make_one(no_leaks, monkeypatch):
    """The check and the record are one store transaction: one of two racing creates wins."""
    monkeypatch.setattr(budget, "pid_max", lambda: 1000)  # a budget of 900: one workspace of 500
    go = threading.Barrier(2)
    made: list[Workspace] = []
    refused: list[BunshinError] = []

    def create() -> None:
        go.wait()
        try:
            made.append(Workspace.create("host", memory="256M", pids=500, config=no_leaks))
        except ResourceExhausted as e:
            refused.append(e)

    threads = [threading.Thread(target=create) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert (len(made), len(refused)) == (1, 1), refused
        assert _records(no_leaks) == ([made[0].id], [])
    finally:
        for w in made:
            w.remove()
