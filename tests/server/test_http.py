"""``bunshin serve`` over real loopback HTTP: every route, auth, error shapes, the protocols.

The client's remote workspaces run the same tools and prefix cache as local ones.
"""

from __future__ import annotations

import asyncio
import os
import stat

import httpx
import pytest

from bunshin import (
    InvalidArgument,
    PathNotFound,
    PrefixCache,
    SnapshotAPI,
    SnapshotNotFound,
    ToolSet,
    Unauthorized,
    WorkspaceAPI,
    WorkspaceNotFound,
)
from bunshin.client import Client, RemoteWorkspace
from bunshin.server import ensure_token

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_health_needs_no_token_and_everything_else_does(served):
    assert httpx.get(f"{served.url}/v1/health").json()["ok"] is True
    r = httpx.get(f"{served.url}/v1/workspaces")
    assert r.status_code == 401 and r.json()["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{served.url}/v1/workspaces", headers={"Authorization": "Bearer wrong-token-xxxxxxxx"})
    assert r.status_code == 401
    with Client(served.url, token="wrong-token-xxxxxxxx") as bad, pytest.raises(Unauthorized):
        bad.list()
    assert httpx.get(f"{served.url}/openapi.json").json()["info"]["title"] == "bunshin"


def test_a_remote_workspace_does_what_a_local_one_does(served):
    with served.client() as c, c.create(memory="1G") as ws:
        assert isinstance(ws, WorkspaceAPI)
        r = ws.exec("echo out; echo err >&2; exit 3", timeout=30)
        assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
        raw = ws.exec(["printf", "\\000\\377x"], text=False)
        assert raw.stdout == b"\x00\xffx"
        assert ws.files.write("/tmp/blob", bytes(range(256))) == 256
        assert ws.files.read("/tmp/blob") == bytes(range(256))
        assert "blob" in [e.name for e in ws.files.list("/tmp")]
        ws.files.remove("/tmp/blob")
        with pytest.raises(PathNotFound):
            ws.files.read("/tmp/blob")
        sid = ws.sessions.open("bash", cwd="/tmp")
        ws.sessions.run(sid, "export K=v; cd /")
        assert ws.sessions.run(sid, "echo $K $PWD", timeout=30).output.strip() == "v /"
        assert [s.session_id for s in ws.sessions.list()] == [sid]
        pid = ws.commands.spawn(["sleep", "60"])
        assert pid in [p.pid for p in ws.processes()]
        assert ws.stats().processes >= 2 and ws.is_alive()
        ws.set_cpu_priority(19)
        ws.set_cpu_priority(0)
        ws.sessions.close(sid)
        assert ws.sessions.list() == [] or not any(s.alive for s in ws.sessions.list())
    with served.client() as c, pytest.raises(WorkspaceNotFound):
        c.get(ws.id)


def test_fork_and_snapshots_over_http(served):
    with served.client() as c:
        ws = c.create(memory="1G")
        try:
            sid = ws.sessions.open("bash", cwd="/tmp")
            ws.sessions.run(sid, "export N=7; echo 1 > n")
            clones = ws.fork(2)
            assert len({cl.id for cl in clones}) == 2
            t = clones.timings  # returned as by a local fork
            assert t.pause_ms > 0 and t.dump_ms > 0 and len(t.restore_ms) == 2 and all(x > 0 for x in t.restore_ms)
            for cl in clones:
                assert cl.sessions.run(sid, "echo $N $(cat n)", timeout=30).output.strip() == "7 1"
                cl.remove()
            snap = ws.snapshot()
            assert isinstance(snap, SnapshotAPI) and snap.size_bytes > 0
            assert snap.id in [s.id for s in c.snapshots()]
            (back,) = snap.restore(1)
            assert back.exec("cat /tmp/n", timeout=30).stdout == "1\n"
            back.remove()
            snap.remove()
            with pytest.raises(SnapshotNotFound):
                c.snapshot(snap.id)
        finally:
            ws.remove()


def test_bad_requests_are_invalid_argument_with_the_fields(served):
    with served.client() as c:
        with pytest.raises(InvalidArgument, match="count"):
            c.create_many(0)
        r = httpx.post(f"{served.url}/v1/workspaces", json={"image": "/etc"},
                       headers={"Authorization": f"Bearer {served.token}"})
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument" and "image" in r.json()["message"]
        with pytest.raises(WorkspaceNotFound):
            c.get("ws-nope")
        assert c.list() == []


def test_create_many_is_all_or_none_and_listed(served):
    with served.client() as c:
        made = c.create_many(2, memory="1G", name="grp")
        try:
            assert {w.id for w in made} == {w.id for w in c.list()}
            assert sorted(w.info.name or "" for w in made) == ["grp-0", "grp-1"]
        finally:
            for w in made:
                w.remove()


def test_tools_and_the_prefix_cache_run_unchanged_on_a_remote_host(served):
    tools = ToolSet.default(workdir="/tmp")
    with served.client() as c:
        ws = c.create(memory="1G")
        try:
            obs = tools.run_sync(ws, "write_file", {"path": "a.txt", "content": "hi\n"})
            assert obs.ok, obs
            assert tools.run_sync(ws, "bash", {"command": "cat a.txt"}).output == "hi\n"
            root = ws.snapshot()
        finally:
            ws.remove()

        async def go():
            cache = PrefixCache(tools)
            outs = []
            for _ in range(2):
                traj = cache.start(root)
                outs.append((await traj.call("bash", {"command": "cat a.txt; echo x >> a.txt"})).output)
                outs.append((await traj.call("read_file", {"path": "a.txt"})).output)
                await traj.close()
            hits = cache.stats().hits
            await cache.aclose()
            return outs, hits

        try:
            outs, hits = asyncio.run(go())
        finally:
            root.remove()
        assert outs == ["hi\n", "hi\nx\n", "hi\n", "hi\nx\n"]
        assert hits == 2  # the second trajectory was served from the tree


def test_the_token_file_is_made_private_and_others_are_refused(tmp_path):
    path = tmp_path / "server.token"
    token = ensure_token(path)
    assert len(token) >= 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="readable by others"):
        ensure_token(path)
    link = tmp_path / "link.token"
    os.symlink(path, link)
    with pytest.raises(InvalidArgument, match="symlink is refused"):
        ensure_token(link)


def test_remote_objects_do_no_io_when_made():
    from bunshin.api.models import WorkspaceOut

    c = Client("http://127.0.0.1:9", token="t" * 20)  # nothing listens there
    ws = RemoteWorkspace(c, WorkspaceOut(id="ws-x", name=None, image="host", state="running", pid=1,
                                         created_at=0.0, parent=None, memory_limit=None, pids_limit=None))
    assert ws.id == "ws-x"
    from bunshin.errors import Unreachable
    with pytest.raises(Unreachable, match="is `bunshin serve` running"):
        ws.exec("true")
    c.close()


def test_tool_calls_over_http(served):
    with served.client() as c, c.create(memory="1G") as ws:
        names = [t["function"]["name"] for t in httpx.get(
            f"{served.url}/v1/tools", headers={"Authorization": f"Bearer {served.token}"}).json()]
        assert {"bash", "read_file", "write_file", "edit", "python"} <= set(names)
        assert ws.run_tool("write_file", {"path": "n.txt", "content": "1\n"}, workdir="/tmp").ok
        assert ws.run_tool("bash", '{"command": "cat /tmp/n.txt"}').output == "1\n"
        bad = ws.run_tool("read_file", {"path": "/nope"})
        assert bad.error and "no such file" in bad.error
        assert "unknown tool" in (ws.run_tool("nope").error or "")
        desk = [t["function"]["name"] for t in httpx.get(
            f"{served.url}/v1/tools", params={"desktop": "true"},
            headers={"Authorization": f"Bearer {served.token}"}).json()]
        assert {"screenshot", "left_click", "press_key"} <= set(desk) and "screenshot" not in names
        no_desktop = ws.run_tool("screenshot")  # a workspace made without one: a tool error saying how
        assert not no_desktop.ok and "desktop" in (no_desktop.error or "")
