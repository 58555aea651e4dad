"""Admission control over real HTTP: caps and the create/fork rate answer 429 + Retry-After,
and the client waits, resends (with the same Idempotency-Key) and gets through."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from bunshin import InvalidArgument, RateLimited
from bunshin.client import Client, Retry
from bunshin.server.admission import Limits
from bunshin.server.thread import serve_in_thread

from .conftest import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.criu]
ONCE = Retry(attempts=1)


class Recording(httpx.HTTPTransport):
    """Keeps every request's method, path, Idempotency-Key and answer status."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str | None, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = super().handle_request(request)
        self.seen.append((request.method, request.url.path, request.headers.get("idempotency-key"), r.status_code))
        return r


@pytest.fixture
def limited(no_leaks, request) -> Iterator[str]:
    with serve_in_thread(no_leaks, TOKEN, limits=request.param) as url:
        yield url


@pytest.mark.parametrize("limited", [Limits(max_workspaces=1)], indirect=True)
def test_the_workspace_cap_answers_429_and_the_retry_gets_in_once_one_is_removed(limited):
    rec = Recording()
    with Client(limited, token=TOKEN, transport=rec) as c:
        first = c.create(memory="1G")
        r = httpx.post(f"{limited}/v1/workspaces", json={"memory": "1G"},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429 and r.json()["code"] == "rate_limited" and int(r.headers["retry-after"]) >= 1
        with Client(limited, token=TOKEN, retry=ONCE) as impatient, pytest.raises(RateLimited, match="cap of 1"):
            impatient.create(memory="1G")
        with pytest.raises(RateLimited):  # forks are admitted like creates
            first.fork(1)
        timer = threading.Timer(1.5, first.remove)  # another caller frees the slot
        timer.start()
        t0 = time.monotonic()
        second = c.create(memory="1G")
        assert time.monotonic() - t0 >= 1.0
        timer.join()
        assert [w.id for w in c.list()] == [second.id]
        creates = [s for s in rec.seen if s[:2] == ("POST", "/v1/workspaces")]
        assert [s[3] for s in creates][-1] == 201 and 429 in [s[3] for s in creates]
        keys = {s[2] for s in creates[1:]}  # every attempt of the second create: one key
        assert len(keys) == 1 and None not in keys and creates[0][2] not in keys
        second.remove()


@pytest.mark.parametrize("limited", [Limits(max_pids=700)], indirect=True)
def test_the_pids_cap_counts_pids_limits_of_creates_forks_and_restores(limited):
    with Client(limited, token=TOKEN, retry=ONCE) as c:
        ws = c.create(memory="256M", pids=512)
        try:
            with pytest.raises(RateLimited, match="pids limits add up to 512"):
                ws.fork(1)
            with pytest.raises(RateLimited, match="cap of 700"):
                c.create(memory="256M", pids=512)
            snap = ws.snapshot()
            try:
                with pytest.raises(RateLimited, match="pids"):
                    snap.restore(1)
            finally:
                snap.remove()
            with pytest.raises(InvalidArgument, match="never fit"):
                c.create_many(8, memory="256M", pids=100)
            small = c.create(memory="256M", pids=128)  # still fits
            small.remove()
            assert [w.id for w in c.list()] == [ws.id]
        finally:
            ws.remove()


def test_serve_caps_memory_at_the_hosts_and_pids_at_the_budget_by_default():
    from bunshin.cli.serve_cmds import _max_memory, _max_pids, _size_or_off
    from bunshin.runtime.state import budget

    assert _max_memory("auto") == psutil.virtual_memory().total and _max_memory("off") is None
    assert _max_memory("64G") == 64 << 30  # more than the host: the operator's overcommit
    assert _max_pids("auto") == budget.pids_budget() and _max_pids("100") == 100
    for bad in ("0", str(budget.pids_budget() + 1), "x"):
        with pytest.raises(InvalidArgument, match="--max-pids"):
            _max_pids(bad)
    assert _size_or_off("32G", "--max-upload") == 32 << 30 and _size_or_off("off", "--max-upload") is None


@pytest.mark.parametrize("limited", [Limits(max_memory=1536 << 20)], indirect=True)
def test_the_memory_cap_counts_memory_limits(limited):
    with Client(limited, token=TOKEN, retry=ONCE) as c:
        ws = c.create(memory="1G")
        try:
            with pytest.raises(RateLimited, match="memory limits add up to 1024 MiB"):
                ws.fork(1)
            with pytest.raises(RateLimited):
                c.create(memory="1G")
            small = c.create(memory="256M")  # still fits
            small.remove()
            with pytest.raises(InvalidArgument, match="never fit"):
                c.create(memory="2G")
            with pytest.raises(InvalidArgument, match="needs a memory limit"):
                c.create(memory=None)
        finally:
            ws.remove()


@pytest.mark.parametrize("limited", [Limits(max_memory=1280 << 20)], indirect=True)
def test_the_memory_cap_counts_what_kept_snapshots_hold(limited):
    """A workspace snapshotted and removed (as an E2B pause does) leaves its memory on
    bunshin's tmpfs: the cap counts it until the snapshot goes, so snapshotting and removing
    does not let a caller fill the host."""
    with Client(limited, token=TOKEN, retry=ONCE) as c:
        ws = c.create(memory="512M")
        try:  # 300 MiB written by a process that stays: the snapshot's memory files hold it
            ws.exec("nohup python3 -c 'import time; b = b\"x\" * (300 << 20); open(\"/tmp/ready\", \"w\"); "
                    "time.sleep(3600)' >/dev/null 2>&1 &")
            deadline = time.monotonic() + 30
            while not ws.exec("test -f /tmp/ready").ok and time.monotonic() < deadline:
                time.sleep(0.1)
            snap = ws.snapshot()
        finally:
            ws.remove()
        try:
            assert snap.size_bytes >= 300 << 20
            a = c.create(memory="512M")  # 512 MiB + the snapshot's ~330 fit in 1280
            try:
                with pytest.raises(RateLimited, match=r"add up to 512 MiB and kept snapshots hold \d+ MiB"):
                    c.create(memory="512M")  # 1024 would fit; with the snapshot's it does not
            finally:
                a.remove()
        finally:
            snap.remove()
        b = c.create(memory="512M")  # the snapshot gone: room again
        b2 = c.create(memory="512M")
        b.remove()
        b2.remove()


@pytest.mark.parametrize("limited", [Limits(rate=1.0, burst=1)], indirect=True)
def test_the_rate_limit_refuses_a_burst_and_the_client_waits_it_out(limited):
    with Client(limited, token=TOKEN, retry=ONCE) as impatient, Client(limited, token=TOKEN) as patient:
        a = patient.create(memory="512M")
        try:
            with pytest.raises(RateLimited, match="rate") as info:
                impatient.create(memory="512M")
            assert 0 < info.value.details["retry_after"] <= 1.0
            t0 = time.monotonic()
            b = patient.create(memory="512M")  # waits Retry-After, then gets in
            waited = time.monotonic() - t0
            b.remove()
            assert waited > 0.2
        finally:
            a.remove()


@pytest.mark.parametrize("limited", [Limits(reserve_memory=psutil.virtual_memory().total)], indirect=True)
def test_nothing_is_made_while_the_host_is_short_of_memory(limited, no_leaks):
    """A reserve above what the host has available (read at the call): every create, fork and
    restore is refused with 429 ``host_memory``; nothing is made."""
    with Client(limited, token=TOKEN, retry=ONCE) as c:
        with pytest.raises(RateLimited) as err:
            c.create(memory="256M")
        assert err.value.details["cap"] == "host_memory" and "available" in err.value.message
        assert c.list() == []
        r = httpx.post(f"{limited}/v1/workspaces", json={"memory": "256M"},
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1


def test_serve_reserves_host_memory_by_default():
    from bunshin.cli.serve_cmds import _reserve

    total = psutil.virtual_memory().total
    assert _reserve("auto") == max(512 << 20, total // 20)
    assert _reserve("off") is None and _reserve("1G") == 1 << 30
    with pytest.raises(InvalidArgument):
        _reserve("lots")


def test_limits_refuse_nonsense():
    for bad in ({"max_workspaces": 0}, {"rate": 0.0}, {"rate": float("inf")}, {"burst": 0},
                {"reserve_memory": 0}):
        with pytest.raises(InvalidArgument):
            Limits(**bad)
    with pytest.raises(InvalidArgument):
        Retry(attempts=0)
