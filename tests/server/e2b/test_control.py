"""E2B's control plane on a real ``bunshin serve`` (loopback), driven by the unmodified
``e2b`` SDK (sync and async): create from a template (a restore), info, list, kill,
timeouts as leases, pause and connect under the same id, live fork of a sandbox holding
state, snapshots as templates, metrics, and the failures: a wrong key, a sandbox that is
not there, bad input, admission's 429. One server and one home for the module."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    RateLimitException,
    SandboxException,
)

from bunshin.config import Config  # noqa: E402
from bunshin.errors import NotFound  # noqa: E402
from bunshin.runtime.state.store import Store  # noqa: E402
from bunshin.server.admission import Limits  # noqa: E402
from bunshin.server.e2b.auth import envd_access_token, traffic_access_token  # noqa: E402
from bunshin.server.e2b.control import ENVD_VERSION  # noqa: E402
from bunshin.server.e2b.sandboxes import Sandboxes, sandbox_envs  # noqa: E402
from bunshin.server.leases import Leases  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from bunshin.workspace import Snapshot, Workspace  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

TOKEN = "test-token-0123456789abcdef"
#: The module server's cap: admission's 429 is reachable with a fork.
MAX_WORKSPACES = 8
NOT_THERE = "ws-000000000000"


@pytest.fixture(scope="module")
def server(cfg: Config) -> Iterator[tuple[str, Config]]:
    """One server for the module; at its end every sandbox and template goes (through the
    API) and nothing of them is left on the host."""
    with serve_in_thread(cfg, TOKEN, limits=Limits(max_workspaces=MAX_WORKSPACES), network="egress") as url:
        yield url, cfg
        with httpx.Client(base_url=url, headers={"X-API-Key": TOKEN}, timeout=60) as c:
            for sb in c.get("/v2/sandboxes").json():
                c.delete(f"/sandboxes/{sb['sandboxID']}")
            for t in c.get("/templates").json():
                assert c.delete(f"/templates/{t['templateID']}").status_code == 204
    assert leftovers(cfg) == {}


@pytest.fixture
def opts(server: tuple[str, Config]) -> dict[str, Any]:
    """What a user changes: the API and sandbox URLs and the key."""
    url = server[0]
    return {"api_url": url, "sandbox_url": url, "api_key": TOKEN}


@pytest.fixture
def api(server: tuple[str, Config]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], headers={"X-API-Key": TOKEN}, timeout=60) as c:
        yield c


def _ws(cfg: Config, sandbox_id: str) -> Workspace:
    return Workspace.get(sandbox_id, config=cfg)


def test_create_info_list_kill(server, opts) -> None:
    cfg = server[1]
    sb = Sandbox.create(timeout=120, metadata={"run": "a", "step": "1"}, envs={"GREETING": "hi"}, **opts)
    other = Sandbox.create(metadata={"run": "b"}, **opts)
    try:
        assert _ws(cfg, sb.sandbox_id).id == sb.sandbox_id  # the sandbox id is the workspace id
        info = sb.get_info()
        assert (info.template_id, info.state, info.metadata) == ("base", SandboxState.RUNNING,
                                                                 {"run": "a", "step": "1"})
        assert info.envd_version == ENVD_VERSION and info.memory_mb == 512
        assert sb._envd_access_token == envd_access_token(TOKEN, sb.sandbox_id)
        assert sb.traffic_access_token == traffic_access_token(TOKEN, sb.sandbox_id)
        assert info.sandbox_domain == f"localhost:{server[0].rsplit(':', 1)[1]}"
        assert 110 < (info.end_at - info.started_at).total_seconds() <= 121
        assert sandbox_envs(cfg, sb.sandbox_id) == {"GREETING": "hi"}

        listed = Sandbox.list(query=SandboxQuery(metadata={"run": "a"}), **opts).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        everything = {s.sandbox_id for s in Sandbox.list(**opts).next_items()}
        assert {sb.sandbox_id, other.sandbox_id} <= everything
    finally:
        assert other.kill()
    assert sb.kill() and not sb.kill()  # the second: not there
    with pytest.raises(NotFoundException):
        sb.get_info()
    with pytest.raises(NotFound):
        _ws(cfg, sb.sandbox_id)


def test_the_environment_is_all_a_user_changes(server, api, monkeypatch) -> None:
    """E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, and nothing in the program; the v1 list
    (running sandboxes, metadata filter) agrees."""
    monkeypatch.setenv("E2B_API_URL", server[0])
    monkeypatch.setenv("E2B_SANDBOX_URL", server[0])
    monkeypatch.setenv("E2B_API_KEY", TOKEN)
    sb = Sandbox.create(metadata={"via": "env vars"})
    try:
        assert Sandbox.get_info(sb.sandbox_id).metadata == {"via": "env vars"}
        shown = api.get("/sandboxes", params={"metadata": "via=env%20vars"}).json()
        assert [s["sandboxID"] for s in shown] == [sb.sandbox_id]
    finally:
        assert sb.kill()


def test_list_pages(server, opts, api) -> None:
    made = [Sandbox.create(metadata={"page": "yes"}, **opts) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": "yes"}), limit=2, **opts)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in made}
        newest_first = [s.started_at for s in first + second]
        assert newest_first == sorted(newest_first, reverse=True)
        r = api.get("/v2/sandboxes", params={"nextToken": "!!not-ours!!"})
        assert r.status_code == 400 and r.json()["code"] == 400
    finally:
        for s in made:
            s.kill()


def test_timeout_is_a_lease(server, opts) -> None:
    cfg = server[1]
    sb = Sandbox.create(timeout=600, **opts)
    sb.set_timeout(30)
    lease = Leases(cfg).get(sb.sandbox_id)
    assert lease is not None and lease.ttl == 30
    sb.set_timeout(1)
    deadline = time.monotonic() + 15
    with pytest.raises(NotFoundException):  # the server's sweeper removed it
        while time.monotonic() < deadline:
            sb.get_info()
            time.sleep(0.2)
    with pytest.raises(NotFound):
        _ws(cfg, sb.sandbox_id)


def test_pause_and_connect_keep_the_id_files_and_processes(server, opts) -> None:
    cfg = server[1]
    sb = Sandbox.create(timeout=300, **opts)
    try:
        ws = _ws(cfg, sb.sandbox_id)
        ws.files.write("/tmp/state.txt", "before pause\n")
        pid = ws.commands.spawn(["sleep", "1000"])
        assert sb.pause()
        assert not sb.pause()  # already paused: the SDK's False (409)
        assert sb.get_info().state == SandboxState.PAUSED
        with pytest.raises(NotFound):
            _ws(cfg, sb.sandbox_id)  # the workspace went
        paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **opts).next_items()
        assert sb.sandbox_id in {s.sandbox_id for s in paused}

        again = sb.connect(timeout=200)
        assert again.sandbox_id == sb.sandbox_id
        assert sb.get_info().state == SandboxState.RUNNING
        ws = _ws(cfg, sb.sandbox_id)
        assert ws.files.read("/tmp/state.txt") == b"before pause\n"
        assert pid in {p.pid for p in ws.processes()}
        assert Sandbox.connect(sb.sandbox_id, **opts).sandbox_id == sb.sandbox_id  # running: 200, same id
    finally:
        sb.kill()


def test_a_paused_sandbox_killed_takes_its_snapshot(server, opts, api) -> None:
    cfg = server[1]
    sb = Sandbox.create(**opts)
    before = {s.id for s in Snapshot.list(config=cfg)}  # the template's among them
    sb.pause()
    assert len({s.id for s in Snapshot.list(config=cfg)} - before) == 1
    r = api.post(f"/sandboxes/{sb.sandbox_id}/fork", json={})
    assert r.status_code == 409 and "paused" in r.json()["message"]
    assert sb.kill()
    assert {s.id for s in Snapshot.list(config=cfg)} == before
    with pytest.raises(NotFoundException):
        sb.get_info()


def test_a_retried_create_makes_one_sandbox(server, api) -> None:
    key = {"Idempotency-Key": "create-once-0001"}
    first = api.post("/v2/sandboxes", json={"templateID": "base"}, headers=key)
    again = api.post("/v2/sandboxes", json={"templateID": "base"}, headers=key)
    try:
        assert first.status_code == again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json()["sandboxID"] == first.json()["sandboxID"]
        other = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60}, headers=key)
        assert other.status_code == 422 and other.json()["code"] == 422  # the key, another request
    finally:
        assert api.delete(f"/sandboxes/{first.json()['sandboxID']}").status_code == 204


def test_fork_of_a_sandbox_holding_state(server, opts) -> None:
    cfg = server[1]
    src = Sandbox.create(timeout=300, metadata={"role": "source"}, envs={"K": "v"}, **opts)
    try:
        _ws(cfg, src.sandbox_id).files.write("/tmp/shared.txt", "from the source\n")
        forks = src.fork(count=2)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        ids = [f.sandbox_id for f in forks]
        assert len(set(ids)) == 2 and src.sandbox_id not in ids
        assert src.get_info().state == SandboxState.RUNNING  # the source keeps running, and its id
        for i, f in enumerate(forks):
            ws = _ws(cfg, f.sandbox_id)
            assert ws.files.read("/tmp/shared.txt") == b"from the source\n"
            ws.files.write("/tmp/mine.txt", f"fork {i}\n")
            assert f.get_info().metadata == {"role": "source"}
            assert sandbox_envs(cfg, f.sandbox_id) == {"K": "v"}
            assert f._envd_access_token == envd_access_token(TOKEN, f.sandbox_id)
        for i, f in enumerate(forks):  # each diverged alone
            assert _ws(cfg, f.sandbox_id).files.read("/tmp/mine.txt") == f"fork {i}\n".encode()
        assert not any(e.name == "mine.txt" for e in _ws(cfg, src.sandbox_id).files.list("/tmp"))
    finally:
        for s in [src, *[f for f in locals().get("forks", []) if isinstance(f, Sandbox)]]:
            s.kill()


def test_snapshots_are_templates(server, opts, api) -> None:
    cfg = server[1]
    src = Sandbox.create(**opts)
    try:
        _ws(cfg, src.sandbox_id).files.write("/tmp/kept.txt", "in the snapshot\n")
        snap = src.create_snapshot(name="kept")
        assert snap.names == ["kept"]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=src.sandbox_id, **opts).next_items()
                ] == [snap.snapshot_id]
        assert [s.snapshot_id for s in Sandbox.list_snapshots(name="kept", **opts).next_items()] == [snap.snapshot_id]
        for template in (snap.snapshot_id, "kept"):
            child = Sandbox.create(template, **opts)
            try:
                assert _ws(cfg, child.sandbox_id).files.read("/tmp/kept.txt") == b"in the snapshot\n"
                assert child.get_info().template_id == snap.snapshot_id
            finally:
                child.kill()
        shown = {t["templateID"]: t for t in api.get("/templates").json()}
        assert shown["base"]["memoryMB"] == 512 and shown["base"]["buildStatus"] == "ready"
        assert shown[snap.snapshot_id]["names"] == ["kept"]
        assert Sandbox.delete_snapshot(snap.snapshot_id, **opts)
        assert not Sandbox.delete_snapshot(snap.snapshot_id, **opts)
        r = api.post("/v2/sandboxes", json={"templateID": snap.snapshot_id})
        assert r.status_code == 404 and r.json()["code"] == 404
    finally:
        src.kill()


def test_metrics(server, opts, api) -> None:
    sb = Sandbox.create(**opts)
    try:
        (m,) = sb.get_metrics()
        assert m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100
        assert 0 < m.mem_used <= m.mem_total == 512 << 20
        assert 0 < m.disk_used <= m.disk_total
        r = api.get("/sandboxes/metrics", params={"sandbox_ids": f"{sb.sandbox_id},{NOT_THERE}"})
        assert list(r.json()["sandboxes"]) == [sb.sandbox_id]
    finally:
        sb.kill()


def test_async_client(server, opts) -> None:
    async def go() -> None:
        sb = await AsyncSandbox.create(metadata={"client": "async"}, **opts)
        try:
            assert (await sb.get_info()).metadata == {"client": "async"}
            (fork,) = await sb.fork()
            assert isinstance(fork, AsyncSandbox) and fork.sandbox_id != sb.sandbox_id
            assert await fork.kill()
            await sb.pause()
            await sb.connect()
            assert (await sb.get_info()).state == SandboxState.RUNNING
        finally:
            await sb.kill()
    asyncio.run(go())


def test_wrong_key(server, opts, api) -> None:
    bad = {**opts, "api_key": "not-the-token"}
    with pytest.raises(AuthenticationException):
        Sandbox.create(**bad)
    with pytest.raises(AuthenticationException):
        Sandbox.list(**bad).next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(NOT_THERE, **bad)
    for method, path in (("GET", "/sandboxes"), ("DELETE", f"/sandboxes/{NOT_THERE}"), ("GET", "/templates"),
                         ("POST", f"/sandboxes/{NOT_THERE}/fork")):
        r = httpx.request(method, server[0] + path)
        assert r.status_code == 401 and r.json()["code"] == 401, (method, path)


def test_not_there(server, opts, api) -> None:
    for sid in (NOT_THERE, "ws-", "a-name", "x" * 300):
        with pytest.raises(NotFoundException):
            Sandbox.get_info(sid, **opts)
    with pytest.raises(NotFoundException):
        Sandbox.connect(NOT_THERE, **opts)
    assert not Sandbox.kill(NOT_THERE, **opts)
    with pytest.raises(NotFoundException):
        Sandbox.set_timeout(NOT_THERE, 10, **opts)
    r = api.post(f"/sandboxes/{NOT_THERE}/fork", json={"count": 1})
    assert r.status_code == 404 and r.json()["code"] == 404


def test_internet_access_is_egress(server, opts, api) -> None:
    """``allow_internet_access`` restores the template's snapshot booted with egress (made
    once, like the plain one) under allowOut/denyOut; by default a sandbox has none; a
    snapshot keeps what its sandbox had. No traffic leaves."""
    cfg = server[1]
    sb = Sandbox.create(allow_internet_access=True, network={"deny_out": ["198.51.100.0/24"]}, **opts)
    plain = Sandbox.create(**opts)
    try:
        ws = _ws(cfg, sb.sandbox_id)
        assert ws.network_address() is not None and sb.get_info().allow_internet_access is True
        assert ws.record.snapshot is not None  # a restore, not a boot
        policy = ws.network_policy()
        assert policy is not None and policy.deny_cidrs == ("198.51.100.0/24",)
        r = api.put(f"/sandboxes/{sb.sandbox_id}/network", json={"allowOut": ["203.0.113.0/24"]})
        assert r.status_code == 204, r.text
        policy = ws.network_policy()
        assert policy is not None and (policy.allow_cidrs, policy.deny_cidrs) == (("203.0.113.0/24",), ())

        online = sb.create_snapshot()
        child = Sandbox.create(online.snapshot_id, allow_internet_access=False, **opts)
        try:  # false on a snapshot with network: E2B's denyOut 0.0.0.0/0
            policy = _ws(cfg, child.sandbox_id).network_policy()
            assert policy is not None and policy.deny_cidrs == ("0.0.0.0/0",)
            assert child.get_info().allow_internet_access is False
        finally:
            child.kill()
        assert Sandbox.delete_snapshot(online.snapshot_id, **opts)

        assert _ws(cfg, plain.sandbox_id).network_address() is None  # the default: no network
        r = api.put(f"/sandboxes/{plain.sandbox_id}/network", json={"allowOut": ["203.0.113.0/24"]})
        assert r.status_code == 409 and r.json()["code"] == 409
        offline = plain.create_snapshot()
        r = api.post("/v2/sandboxes", json={"templateID": offline.snapshot_id, "allow_internet_access": True})
        assert r.status_code == 400 and "without internet access" in r.json()["message"]
        assert Sandbox.delete_snapshot(offline.snapshot_id, **opts)
    finally:
        sb.kill()
        plain.kill()


def test_a_server_without_egress_refuses_internet_access(cfg) -> None:
    """`bunshin serve`'s --network is the ceiling of E2B's routes too (none by default)."""
    with serve_in_thread(cfg, TOKEN) as url, httpx.Client(base_url=url, headers={"X-API-Key": TOKEN}, timeout=60) as c:
        for body in ({"templateID": "base", "allow_internet_access": True},
                     {"templateID": "base", "network": {"allowOut": ["203.0.113.0/24"]}}):
            r = c.post("/v2/sandboxes", json=body)
            assert r.status_code == 400 and "bunshin serve --network egress" in r.json()["message"], r.text


def test_bad_input(server, opts, api) -> None:
    with pytest.raises(SandboxException, match="not found"):
        Sandbox.create("no-such-template", **opts)
    sb = Sandbox.create(allow_internet_access=False, **opts)
    try:
        assert sb.get_info().allow_internet_access is False
        for body in ({"templateID": "base", "metadata": {f"k{i}": "v" for i in range(65)}},
                     {"templateID": "base", "metadata": {"k": "v" * 2000}},
                     {"templateID": "base", "envVars": {"1BAD": "x"}},
                     {"templateID": "base", "timeout": 0},
                     {"templateID": ""},
                     {"templateID": "base", "autoPause": True},
                     {"templateID": "base", "network": {"allowPublicTraffic": True}},
                     {"templateID": "base", "allow_internet_access": False, "network": {"allowOut": ["1.1.1.1"]}},
                     {"templateID": "base", "network": {"allowOut": "1.1.1.1"}},
                     {"metadata": {}}):
            r = api.post("/v2/sandboxes", json=body)
            assert r.status_code == 400 and r.json()["code"] == 400 and r.json()["message"], (body, r.text)
        for count in (0, 2000, "x"):
            r = api.post(f"/sandboxes/{sb.sandbox_id}/fork", json={"count": count})
            assert r.status_code == 400, (count, r.text)
        r = api.post(f"/sandboxes/{sb.sandbox_id}/pause", json={"memory": False})
        assert r.status_code == 400 and "filesystem-only" in r.json()["message"]
        r = api.post("/v3/templates", json={"name": "mine"})
        assert r.status_code == 400 and "building templates is not supported" in r.json()["message"]
        assert sb.get_info().state == SandboxState.RUNNING  # none of it touched the sandbox
    finally:
        sb.kill()


def test_admission_429_is_a_rate_limit(server, opts, api) -> None:
    sb = Sandbox.create(**opts)
    try:
        r = api.post(f"/sandboxes/{sb.sandbox_id}/fork", json={"count": MAX_WORKSPACES})
        assert r.status_code == 429 and r.json()["code"] == 429 and r.headers["Retry-After"] == "1"
        with pytest.raises(RateLimitException):
            sb.fork(count=MAX_WORKSPACES, retries=0)
        assert len([s for s in Sandbox.list(**opts).next_items()]) == 1  # nothing was made
    finally:
        sb.kill()


def test_a_caller_that_hangs_up_leaves_nothing(server, opts, api, monkeypatch) -> None:
    """The create's client is gone before its answer: the restored workspace is removed and no
    record is kept (``ServerContext.keep``). What the create restored is seen by a spy on the
    real restore (a made-ahead clone makes the workspace too short-lived to catch in a list)."""
    cfg = server[1]
    made: list[str] = []
    restore = Snapshot.restore

    def seen_restore(self: Snapshot, *args: Any, **kwargs: Any) -> list[Workspace]:
        out = restore(self, *args, **kwargs)
        made.extend(w.id for w in out)
        return out

    monkeypatch.setattr(Snapshot, "restore", seen_restore)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server[0] + "/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": TOKEN},
                   timeout=0.001)
    deadline = time.monotonic() + 20

    def left() -> set[str]:
        with Store.open(cfg.db_path) as store:
            return {r.id for r in store.list_workspaces()} & set(made)

    while not made or left():  # the restore runs on, then its workspace goes
        assert time.monotonic() < deadline, f"made {made}, left {left()}"
        time.sleep(0.02)
    assert not {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} & set(made)
    assert not set(Sandboxes(cfg).records()) & set(made)


def test_an_unnamed_failure_is_e2b_shaped(server, opts, monkeypatch) -> None:
    """A failure bunshin does not name (here: the store's disk gone, injected) answers 500 in
    E2B's shape, which the SDK raises as its SandboxException with the message."""
    from bunshin.server.e2b import sandboxes

    def broken(self: Any, sandbox_id: str) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(sandboxes.Sandboxes, "get", broken)
    with pytest.raises(SandboxException, match="500.*OSError.*Input/output error"):
        Sandbox.get_info(NOT_THERE, **opts)
