"""E2B's sandbox logs (``GET /sandboxes/{id}/logs``, ``/v2/sandboxes/{id}/logs``) on a real
``bunshin serve``: a sandbox driven by the unmodified e2b SDK (create, commands, timeout, fork,
pause, connect, kill) and its logs read with the SDK's own API client; filters, pages in both
directions, bad input, a wrong key, a sandbox that is not there; the rings' bounds."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("e2b")
from e2b import (  # noqa: E402
    CommandExitException,  # noqa: E402
    ConnectionConfig,
    Sandbox,
)
from e2b.api.client.api.sandboxes import (  # noqa: E402
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection, SandboxLogs, SandboxLogsV2Response  # noqa: E402
from e2b.sandbox_sync.paginator import get_api_client  # noqa: E402

from bunshin.config import Config  # noqa: E402
from bunshin.server.e2b import sandbox_logs  # noqa: E402
from bunshin.server.e2b.sandbox_logs import Level  # noqa: E402
from bunshin.server.e2b.sandbox_logs import SandboxLogs as Rings
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import drop_everything  # noqa: E402

pytestmark = pytest.mark.integration
TOKEN = "test-token-logs-0123456789abcdef"


@pytest.fixture(scope="module")
def lived(cfg: Config) -> Iterator[tuple[str, str, str]]:
    """A server, and a sandbox that lived a life (its fork too): (url, sandbox id, fork id)."""
    with serve_in_thread(cfg, TOKEN) as url:
        opts = {"api_url": url, "sandbox_url": url, "api_key": TOKEN}
        try:
            sb = Sandbox.create(timeout=120, **opts)
            assert sb.commands.run("echo hi").stdout == "hi\n"
            with pytest.raises(CommandExitException):
                sb.commands.run("exit 3")
            sb.set_timeout(60)
            (fork,) = sb.fork(count=1)
            sb.pause()
            Sandbox.connect(sb.sandbox_id, **opts)
            fork.kill()
            yield url, sb.sandbox_id, fork.sandbox_id
        finally:
            drop_everything(url, TOKEN)
    assert leftovers(cfg) == {}


def _v2(url: str, sid: str, **query: Any) -> SandboxLogsV2Response:
    client = get_api_client(ConnectionConfig(api_url=url, api_key=TOKEN))
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(sid, client=client, **query)
    assert res.status_code == 200 and isinstance(res.parsed, SandboxLogsV2Response), res.content
    return res.parsed


def _events(logs: SandboxLogsV2Response) -> list[str]:
    return [e.fields["event"] for e in logs.logs]


def test_a_sandboxs_life_in_its_logs(lived) -> None:
    url, sid, fork_id = lived
    logs = _v2(url, sid)
    assert _events(logs) == ["created", "process.start", "process.end", "process.start", "process.end", "timeout",
                             "fork", "paused", "resumed"]
    first = logs.logs[0]
    assert first.message == "sandbox created from template base (timeout 120 s)"
    assert (first.level, first.fields["sandboxID"], first.fields["templateID"]) == (LogLevel.INFO, sid, "base")
    start, end = logs.logs[3], logs.logs[4]
    assert start.message.startswith(f"process {start.fields['pid']} started: ") and "exit 3" in start.message
    assert (end.level, end.fields["status"]) == (LogLevel.WARN, "exit status 3")
    assert logs.logs[6].fields["count"] == "1" and fork_id in logs.logs[6].message
    times = [e.timestamp for e in logs.logs]
    assert times == sorted(times) and len(set(times)) == len(times)
    forked = _v2(url, fork_id)  # killed: its logs stay readable
    assert _events(forked) == ["forked", "killed"]
    assert forked.logs[0].fields["sourceID"] == sid


def test_a_sandbox_whose_timeout_runs_out(lived) -> None:
    url = lived[0]
    sb = Sandbox.create(timeout=1, api_url=url, sandbox_url=url, api_key=TOKEN)
    deadline = time.monotonic() + 15
    while "expired" not in (events := _events(_v2(url, sb.sandbox_id))):  # the server sweeps once a second
        assert time.monotonic() < deadline, events
        time.sleep(0.1)
    assert events == ["created", "expired"]
    assert not sb.is_running()


def test_filters_and_pages(lived) -> None:
    url, sid, _ = lived
    everything = _v2(url, sid).logs
    warned = _v2(url, sid, level=LogLevel.WARN).logs
    assert [e.fields["status"] for e in warned] == ["exit status 3"]
    assert len(_v2(url, sid, level=LogLevel.DEBUG).logs) == len(everything)
    assert [e.fields["event"] for e in _v2(url, sid, search="exit status").logs] == ["process.end"] * 2
    assert _v2(url, sid, search="EXIT STATUS").logs == []  # case-sensitive
    # forward pages: a cursor is a time in ms, inclusive; the next page starts 1 ms after the last
    pages, cursor = [], 0
    while True:
        page = _v2(url, sid, cursor=cursor, limit=4).logs
        pages.append(page)
        if len(page) < 4:
            break
        cursor = int(page[-1].timestamp.timestamp() * 1000) + 1
    assert [e.message for p in pages for e in p] == [e.message for e in everything] and len(pages) == 3
    back = _v2(url, sid, direction=LogsDirection.BACKWARD, limit=3).logs
    assert [e.message for e in back] == [e.message for e in reversed(everything[-3:])]  # newest first
    before = int(back[-1].timestamp.timestamp() * 1000) - 1
    older = _v2(url, sid, direction=LogsDirection.BACKWARD, cursor=before, limit=100).logs
    assert [e.message for e in older] == [e.message for e in reversed(everything[:-3])]
    assert _v2(url, sid, limit=0).logs == []


def test_the_v1_route(lived) -> None:
    url, sid, _ = lived
    everything = _v2(url, sid).logs
    client = get_api_client(ConnectionConfig(api_url=url, api_key=TOKEN))
    res = get_sandboxes_sandbox_id_logs.sync_detailed(sid, client=client)
    assert res.status_code == 200 and isinstance(res.parsed, SandboxLogs), res.content
    assert [e.message for e in res.parsed.log_entries] == [e.message for e in everything]
    lines = [json.loads(line.line) for line in res.parsed.logs]
    assert [(x["message"], x["level"], x["event"]) for x in lines] == [
        (e.message, e.level.value, e.fields["event"]) for e in everything]
    start = int(everything[2].timestamp.timestamp() * 1000)
    later = get_sandboxes_sandbox_id_logs.sync_detailed(sid, client=client, start=start, limit=2).parsed
    assert isinstance(later, SandboxLogs)
    assert [e.message for e in later.log_entries] == [e.message for e in everything[2:4]]


def test_refusals(lived) -> None:
    url, sid, _ = lived
    with httpx.Client(base_url=url, headers={"X-API-Key": TOKEN}) as api:
        for path in ("/v2/sandboxes/ws-000000000000/logs", "/sandboxes/ws-000000000000/logs",
                     "/v2/sandboxes/not-an-id/logs"):
            r = api.get(path)
            assert r.status_code == 404 and r.json()["code"] == 404, (path, r.text)
        for query in ({"limit": 1001}, {"limit": -1}, {"cursor": -1}, {"direction": "sideways"},
                      {"level": "fatal"}, {"search": "x" * 257}, {"cursor": "soon"}):
            r = api.get(f"/v2/sandboxes/{sid}/logs", params=query)
            assert r.status_code == 400 and r.json()["code"] == 400, (query, r.text)
        assert api.get(f"/sandboxes/{sid}/logs", params={"start": -5}).status_code == 400
        for key in ("wrong", ""):
            r = httpx.get(f"{url}/v2/sandboxes/{sid}/logs", headers={"X-API-Key": key})
            assert r.status_code == 401 and r.json()["code"] == 401


def test_rings_are_bounded(monkeypatch) -> None:
    rings = Rings()
    for i in range(3 * sandbox_logs.MAX_ENTRIES):
        rings.record("ws-000000000001", Level.INFO, f"entry {i}", n=i)
    kept = rings.entries("ws-000000000001")
    assert len(kept) == sandbox_logs.MAX_ENTRIES and kept[-1].message == f"entry {3 * sandbox_logs.MAX_ENTRIES - 1}"
    assert all(a.ms < b.ms for a, b in zip(kept, kept[1:], strict=False))  # one entry per ms: cursors are exact
    rings.record("ws-000000000002", Level.ERROR, "x" * 100_000, big="y" * 100_000, **{f"k{i}": i for i in range(99)})
    (cut,) = rings.entries("ws-000000000002")
    assert len(cut.message) == sandbox_logs.MAX_MESSAGE and cut.message.endswith("…")
    assert len(cut.fields) == 16 and all(len(v) <= sandbox_logs.MAX_FIELD for _, v in cut.fields)
    for _ in range(200):  # bytes: long entries push out the oldest
        rings.record("ws-000000000002", Level.INFO, "z" * 1000)
    assert sum(e.size for e in rings.entries("ws-000000000002")) <= sandbox_logs.MAX_BYTES
    monkeypatch.setattr(sandbox_logs, "MAX_SANDBOXES", 3)
    for n in range(3, 6):
        rings.record(f"ws-00000000000{n}", Level.INFO, "made")
    rings.record("ws-000000000004", Level.INFO, "written again")  # the least recently written go first
    rings.record("ws-000000000006", Level.INFO, "made")
    assert [s for s in (f"ws-00000000000{n}" for n in range(1, 7)) if rings.has(s)] == [
        "ws-000000000004", "ws-000000000005", "ws-000000000006"]
