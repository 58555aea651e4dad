"""Idempotency-Key over real HTTP: a retried create, fork, snapshot or restore makes nothing twice."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from bunshin import BunshinError, IdempotencyKeyReused, RequestInProgress
from bunshin.runtime.state.store import Store
from bunshin.server.idempotency import KIND, TTL_S, Entry, Idempotency, fingerprint
from bunshin.server.thread import serve_in_thread

from .conftest import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.criu]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _post(url: str, path: str, body: dict, key: str, header: str = "Idempotency-Key") -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={**AUTH, header: key}, timeout=120)


def test_a_retried_create_and_fork_make_one(served):
    body = {"memory": "1G", "name": "idem"}
    first = _post(served.url, "/v1/workspaces", body, "create-1")
    again = _post(served.url, "/v1/workspaces", body, "create-1")
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    with served.client() as c:
        (ws,) = [c.get(w["id"]) for w in first.json()]
        try:
            assert [w.id for w in c.list()] == [ws.id]
            path = f"/v1/workspaces/{ws.id}/fork"
            f1 = _post(served.url, path, {"count": 2}, "fork-1")
            f2 = _post(served.url, path, {"count": 2, "mode": "cow"}, "fork-1")  # the same request, spelled out
            assert f1.status_code == f2.status_code == 200 and f1.json() == f2.json()
            forks = [w["id"] for w in f1.json()["forks"]]
            assert sorted(w.id for w in c.list()) == sorted([ws.id, *forks])
            # X-Request-ID is a key too: one snapshot for two takes
            s1 = _post(served.url, f"/v1/workspaces/{ws.id}/snapshots", {}, "snap-1", header="X-Request-ID")
            s2 = _post(served.url, f"/v1/workspaces/{ws.id}/snapshots", {}, "snap-1", header="X-Request-ID")
            assert s1.status_code == s2.status_code == 201 and s1.json()["id"] == s2.json()["id"]
            assert sorted(s.id for s in c.snapshots()) == sorted([s1.json()["id"], f1.json()["snapshot"]])
            r1 = _post(served.url, f"/v1/snapshots/{s1.json()['id']}/restore", {"count": 1}, "restore-1")
            r2 = _post(served.url, f"/v1/snapshots/{s1.json()['id']}/restore", {"count": 1}, "restore-1")
            assert r1.json() == r2.json() and len(c.list()) == 4
            for w in [*forks, *(x["id"] for x in r1.json())]:
                c.get(w).remove()
            c.snapshot(s1.json()["id"]).remove()
        finally:
            ws.remove()


def test_the_same_key_with_another_request_is_refused(served):
    with served.client() as c:
        ws = c.create(memory="1G")
        try:
            path = f"/v1/workspaces/{ws.id}/fork"
            made = _post(served.url, path, {"count": 1}, "k")
            assert made.status_code == 200
            for other_path, body in ((path, {"count": 2}), ("/v1/workspaces", {"memory": "1G"})):
                r = _post(served.url, other_path, body, "k")
                assert r.status_code == 422 and r.json()["code"] == "idempotency_key_reused", r.text
                assert isinstance(BunshinError.from_dict(r.json()), IdempotencyKeyReused)  # as the client raises it
            assert len(c.list()) == 2
            c.get(made.json()["forks"][0]["id"]).remove()
        finally:
            ws.remove()


def test_a_failed_call_stores_nothing_and_its_retry_runs_anew(served):
    """A create refused (the name is taken) made nothing: its key keeps no answer, so the same
    retry after the cause is gone makes the workspace instead of replaying the old error."""
    body = {"memory": "1G", "name": "taken"}
    with served.client() as c:
        holder = c.create(memory="1G", name="taken")
        try:
            refused = _post(served.url, "/v1/workspaces", body, "retry-me")
            assert refused.status_code == 400 and "already exists" in refused.json()["message"], refused.text
            assert served.config is not None
            with Store.open(served.config.db_path) as store:
                assert store.get_object(KIND, "retry-me") is None
        finally:
            holder.remove()
        made = _post(served.url, "/v1/workspaces", body, "retry-me")
        assert made.status_code == 201 and "idempotent-replayed" not in made.headers, made.text
        c.get(made.json()[0]["id"]).remove()


def test_a_restarted_server_still_answers_the_retry(no_leaks):
    body = {"memory": "1G"}
    with serve_in_thread(no_leaks, TOKEN) as url:
        first = _post(url, "/v1/workspaces", body, "across-restart")
    with serve_in_thread(no_leaks, TOKEN) as url:
        again = _post(url, "/v1/workspaces", body, "across-restart")
        listed = httpx.get(f"{url}/v1/workspaces", headers=AUTH).json()
        assert again.json() == first.json() and [w["id"] for w in listed] == [first.json()[0]["id"]]
        assert httpx.delete(f"{url}/v1/workspaces/{listed[0]['id']}", headers=AUTH).status_code == 204


def test_a_call_in_flight_answers_409_and_then_its_answer(cfg):
    """Stripe's rule: the second caller is told to retry, not held; the retry gets the first answer."""
    idem = Idempotency(cfg)
    started, go_on, calls = threading.Event(), threading.Event(), []

    def slow() -> dict:
        calls.append(1)
        started.set()
        go_on.wait(10)
        return {"made": 1}

    t = threading.Thread(target=idem.run, args=("inflight", "POST", "/x", None, 201, slow))
    t.start()
    assert started.wait(10)
    with pytest.raises(RequestInProgress) as info:
        idem.run("inflight", "POST", "/x", None, 201, slow)
    assert info.value.details["retry_after"] >= 1
    go_on.set()
    t.join(10)
    replay = idem.run("inflight", "POST", "/x", None, 201, slow)
    assert (replay.status_code, replay.body, calls) == (201, b'{"made":1}', [1])
    _forget(cfg, "inflight")


def test_a_claim_of_a_dead_server_is_taken_over_and_answers_expire(cfg):
    with Store.open(cfg.db_path) as store:  # a server killed mid-call left its claim
        store.put_object(KIND, "orphan", Entry(fingerprint("POST", "/x", None), "dead-run", time.time()).to_json())
    calls: list[int] = []
    assert Idempotency(cfg).run("orphan", "POST", "/x", None, 201, lambda: calls.append(1)).status_code == 201
    short = Idempotency(cfg, ttl_s=0.05)
    short.run("brief", "POST", "/x", None, 200, lambda: calls.append(2))
    time.sleep(0.1)
    short.run("brief", "POST", "/x", None, 200, lambda: calls.append(3))
    assert calls == [1, 2, 3]
    _forget(cfg, "orphan", "brief")


def test_the_sweep_deletes_expired_answers_and_keeps_the_rest(cfg):
    now = time.time()
    with Store.open(cfg.db_path) as store:
        store.put_object(KIND, "old", Entry("f", "run", now - 2 * TTL_S, 200, {}).to_json())
        store.put_object(KIND, "new", Entry("f", "run", now - TTL_S / 2, 200, {}).to_json())
    Idempotency(cfg).run("trigger", "POST", "/x", None, 200, dict)  # a new server's first claim sweeps
    with Store.open(cfg.db_path) as store:
        ids = {k for k, _ in store.list_objects(KIND)}
    assert "old" not in ids and {"new", "trigger"} <= ids
    _forget(cfg, "new", "trigger")


def _forget(cfg, *keys: str) -> None:
    with Store.open(cfg.db_path) as store:
        for k in keys:
            store.delete_object(KIND, k)
