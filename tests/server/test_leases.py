"""Nothing outlives a trainer that went away: workspace leases (``ttl``), and calls whose
caller hung up before the answer (what they made is removed at once)."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest

from bunshin.config import Config
from bunshin.errors import InvalidArgument, WorkspaceNotFound
from bunshin.server.leases import Leases
from bunshin.server.thread import serve_in_thread
from bunshin.workspace import Workspace

from .conftest import TOKEN, Served

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _ids(served: Served) -> set[str]:
    with served.client() as c:
        return {w.id for w in c.list()}


def _wait_until(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        time.sleep(0.1)


def test_a_leased_workspace_is_removed_when_its_lease_ends(served):
    with served.client() as c:
        keep = c.create(memory="256M")  # no lease: stays
        ws = c.create(memory="256M", ttl=1.5)
        assert ws.info.expires_at is not None and ws.info.expires_at - time.time() <= 1.5
        assert c.get(ws.id).info.expires_at == pytest.approx(ws.info.expires_at)
        assert ws.exec("echo alive").stdout == "alive\n"
        _wait_until(lambda: ws.id not in _ids(served), what="the leased workspace to go")
        with pytest.raises(WorkspaceNotFound):
            ws.exec("true")
        assert keep.is_alive() and keep.info.expires_at is None
        keep.remove()


def test_clones_take_their_parents_lease_unless_the_fork_names_one(served):
    with served.client() as c:
        parent = c.create(memory="256M", ttl=600)
        (inherits,) = parent.fork(1)
        (own,) = parent.fork(1, ttl=1.0)
        assert inherits.info.expires_at is not None and inherits.info.expires_at - time.time() > 500
        _wait_until(lambda: own.id not in _ids(served), what="the clone with a short lease to go")
        assert inherits.id in _ids(served) and parent.id in _ids(served)
        for w in (inherits, parent):
            w.remove()


def test_a_lease_is_renewed_or_lifted(served):
    with served.client() as c:
        ws = c.create(memory="256M", ttl=2.0)
        later = ws.set_ttl(600)
        assert later is not None and later - time.time() > 500
        time.sleep(3.0)  # past the first lease
        assert ws.is_alive()
        assert ws.set_ttl(None) is None and c.get(ws.id).info.expires_at is None
        with pytest.raises(InvalidArgument):  # a lease must be positive
            ws.set_ttl(0)
        with pytest.raises(InvalidArgument):  # and at most 30 days
            c.create(memory="256M", ttl=31 * 24 * 3600)
        ws.remove()
        with pytest.raises(WorkspaceNotFound):
            ws.set_ttl(60)


def test_restored_workspaces_take_the_lease_asked_for(served):
    with served.client() as c:
        ws = c.create(memory="256M")
        snap = ws.snapshot()
        (a, b) = snap.restore(2, ttl=1.0)
        _wait_until(lambda: not {a.id, b.id} & _ids(served), what="the restored workspaces to go")
        snap.remove()
        ws.remove()


def test_leases_survive_a_restart(no_leaks: Config):
    with serve_in_thread(no_leaks, TOKEN) as url:
        with Served(url, TOKEN).client() as c:
            ws_id = c.create(memory="256M", ttl=3.0).id
    # no server: the workspace runs on, its lease in the store
    assert Workspace.get(ws_id, config=no_leaks).is_alive()
    lease = Leases(no_leaks).get(ws_id)
    assert lease is not None and lease.ttl == 3.0
    with serve_in_thread(no_leaks, TOKEN) as url:
        served = Served(url, TOKEN)
        _wait_until(lambda: ws_id not in _ids(served), what="the restarted server to end the lease")
    assert Leases(no_leaks).get(ws_id) is None


def _hang_up_mid_call(url: str, method: str, path: str, body: dict, *, key: str | None = None) -> None:
    """Send one request, then close the connection before any answer (as a killed trainer)."""
    u = urlparse(url)
    data = json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", f"Authorization: Bearer {TOKEN}",
            "Content-Type: application/json", f"Content-Length: {len(data)}"]
    if key is not None:
        head.append(f"Idempotency-Key: {key}")
    with socket.create_connection((u.hostname, u.port)) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        time.sleep(0.05)  # the server has the request: the fork is under way


def test_a_caller_that_hangs_up_mid_fork_leaves_nothing(served):
    with served.client() as c:
        parent = c.create(memory="256M")
        _hang_up_mid_call(served.url, "POST", f"/v1/workspaces/{parent.id}/fork", {"count": 3})
        # the fork finishes on the server, finds nobody to tell, and removes its clones
        time.sleep(1.0)
        _wait_until(lambda: _ids(served) == {parent.id}, what="the abandoned clones to go")
        assert parent.exec("echo still-here").stdout == "still-here\n"
        parent.remove()


def test_a_keyed_call_whose_caller_hung_up_runs_anew_on_retry(served):
    """The key of an abandoned fork is freed with its clones: the retry makes new ones."""
    with served.client() as c:
        parent = c.create(memory="256M")
        _hang_up_mid_call(served.url, "POST", f"/v1/workspaces/{parent.id}/fork", {"count": 2}, key="k-1")
        time.sleep(1.0)
        _wait_until(lambda: _ids(served) == {parent.id}, what="the abandoned clones to go")
        retry = c._http.post(f"/v1/workspaces/{parent.id}/fork", json={"count": 2},
                             headers={"Idempotency-Key": "k-1"}, timeout=120)
        assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers
        forks = [f["id"] for f in retry.json()["forks"]]
        assert len(forks) == 2 and set(forks) <= _ids(served)
        again = c._http.post(f"/v1/workspaces/{parent.id}/fork", json={"count": 2},
                             headers={"Idempotency-Key": "k-1"}, timeout=120)
        assert again.headers.get("Idempotent-Replayed") == "true" and again.json() == retry.json()
        for ws_id in _ids(served):
            c.get(ws_id).remove()


def test_a_caller_that_hangs_up_mid_create_leaves_nothing(served):
    _hang_up_mid_call(served.url, "POST", "/v1/workspaces", {"count": 2, "memory": "256M"})
    time.sleep(1.0)
    _wait_until(lambda: _ids(served) == set(), what="the abandoned workspaces to go")


def test_the_servers_default_lease_applies_to_workspaces_made_without_one(no_leaks: Config):
    with serve_in_thread(no_leaks, TOKEN, default_ttl=1.0) as url:
        served = Served(url, TOKEN)
        with served.client() as c:
            own = c.create(memory="256M", ttl=600)
            default = c.create(memory="256M")
            assert default.info.expires_at is not None
            _wait_until(lambda: default.id not in _ids(served), what="the default lease to end")
            assert own.id in _ids(served)
            own.remove()
