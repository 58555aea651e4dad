"""AsyncClient over real HTTP does what Client does: its workspaces are AsyncWorkspace over
remote ones, and the tools and the prefix cache run on them unchanged."""

from __future__ import annotations

import asyncio

import pytest

from bunshin import (
    AsyncSnapshot,
    AsyncWorkspace,
    PrefixCache,
    RateLimited,
    ToolSet,
    WorkspaceNotFound,
)
from bunshin.client import AsyncClient, RemoteWorkspace, Retry
from bunshin.server.admission import Limits
from bunshin.server.thread import serve_in_thread

from .conftest import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_exec_fork_snapshot_restore(served):
    async def go() -> None:
        async with AsyncClient(served.url, token=TOKEN) as c:
            assert (await c.health()).ok
            ws = await c.create(memory="1G")
            assert isinstance(ws, AsyncWorkspace) and isinstance(ws.sync, RemoteWorkspace)
            try:
                r = await ws.exec("echo 1 > /tmp/n; echo out; exit 3", timeout=30)
                assert (r.exit_code, r.stdout) == (3, "out\n")
                clones = await ws.fork(2)
                outs = await asyncio.gather(*(cl.exec("cat /tmp/n", timeout=30) for cl in clones))
                assert [o.stdout for o in outs] == ["1\n", "1\n"]
                assert sorted(w.id for w in await c.list()) == sorted([ws.id, *(cl.id for cl in clones)])
                for cl in clones:
                    await cl.remove()
                snap = await ws.snapshot()
                assert isinstance(snap, AsyncSnapshot)
                assert snap.id in [s.id for s in await c.snapshots()]
                (back,) = await (await c.snapshot(snap.id)).restore(1)
                assert (await back.files.read_text("/tmp/n")) == "1\n"
                await back.remove()
                await snap.remove()
                assert (await c.get(ws.id)).id == ws.id
            finally:
                await ws.remove()
            with pytest.raises(WorkspaceNotFound):
                await c.get(ws.id)

    asyncio.run(go())


def test_tools_and_the_prefix_cache_through_the_async_client(served):
    tools = ToolSet.default(workdir="/tmp")

    async def go() -> tuple[list[str], int]:
        async with AsyncClient(served.url, token=TOKEN) as c:
            ws = await c.create(memory="1G")
            try:
                assert (await tools.run(ws, "write_file", {"path": "a.txt", "content": "hi\n"})).ok
                assert (await tools.run(ws, "bash", {"command": "cat a.txt"})).output == "hi\n"
                root = await ws.snapshot()
            finally:
                await ws.remove()
            cache = PrefixCache(tools)
            outs = []
            try:
                for _ in range(2):
                    traj = cache.start(root.sync)
                    outs.append((await traj.call("bash", {"command": "cat a.txt; echo x >> a.txt"})).output)
                    outs.append((await traj.call("read_file", {"path": "a.txt"})).output)
                    await traj.close()
                hits = cache.stats().hits
            finally:
                await cache.aclose()
                await root.remove()
            return outs, hits

    outs, hits = asyncio.run(go())
    assert outs == ["hi\n", "hi\nx\n", "hi\n", "hi\nx\n"] and hits == 2


def test_the_async_client_is_admitted_and_retried_like_the_sync_one(no_leaks):
    async def go(url: str) -> None:
        async with AsyncClient(url, token=TOKEN) as c, AsyncClient(url, token=TOKEN,
                                                                    retry=Retry(attempts=1)) as once:
            a = await c.create(memory="512M")
            with pytest.raises(RateLimited):
                await once.create(memory="512M")
            freeing = asyncio.get_running_loop().call_later(1.2, lambda: asyncio.ensure_future(a.remove()))
            b = await c.create(memory="512M")  # waits in its bridge thread until a is gone
            assert [w.id for w in await c.list()] == [b.id]
            freeing.cancel()
            await b.remove()

    with serve_in_thread(no_leaks, TOKEN, limits=Limits(max_workspaces=1)) as url:
        asyncio.run(go(url))
