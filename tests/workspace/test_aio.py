"""AsyncWorkspace: one call at a time per workspace, cancel-safe, over any implementation.

The unit tests drive the in-memory fake (``bunshin.testing``); the last ones drive a
real workspace (namespaces, CRIU) through the same adapter.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from bunshin import AsyncWorkspace, ThreadBridge
from bunshin.errors import AgentError, InvalidArgument
from bunshin.testing import FakeWorld
from bunshin.workspace.aio import AsyncSnapshot


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def world():
    w = FakeWorld()
    yield w


def test_features_hang_off_sub_objects(world):
    aws = AsyncWorkspace(world.create(workdir="/w"))

    async def go():
        await aws.files.write("/w/a", "1\n")
        sid = await aws.sessions.open("bash", cwd="/w")
        r = await aws.sessions.run(sid, "export K=v; inc a; echo $K")
        e = await aws.exec("cat /w/a")
        return r.output, e.stdout, [s.session_id for s in await aws.sessions.list()]

    assert run(go()) == ("2\nv\n", "2", ["s1"])
    assert aws.sync.state.files["/w/a"] == b"2"


def test_calls_into_one_workspace_never_overlap(world):
    # The fake refuses a fork while a call is in flight, like the real runtime.
    aws = AsyncWorkspace(world.create())

    async def go():
        sid = await aws.sessions.open()
        slow = asyncio.ensure_future(aws.sessions.run(sid, "sleep 0.2; echo done"))
        await asyncio.sleep(0.02)
        clones = await aws.fork(2)  # waits for the call instead of failing
        return (await slow).output, clones

    out, clones = run(go())
    assert out == "done\n" and len(clones) == 2
    assert world.counts["fork"] == 1


def test_without_the_lock_the_fake_refuses_a_fork_under_a_call(world):
    """The check above can fail: the same overlap, bypassing the adapter's lock, is refused."""
    ws = world.create()
    sid = ws.sessions.open()
    t = threading.Thread(target=ws.sessions.run, args=(sid, "sleep 0.2"))
    t.start()
    time.sleep(0.05)
    with pytest.raises(AgentError, match="while a call is in flight"):
        ws.fork(1)
    t.join()


def test_two_adapters_and_a_thread_share_the_workspace_lock(world):
    """Two AsyncWorkspaces over one workspace (a cache's and a server route's view of it) and a
    thread holding the process's lock of its id (a route) never overlap: the fork waits."""
    from bunshin.workspace.locks import workspace_locks

    ws = world.create()
    a, b = AsyncWorkspace(ws), AsyncWorkspace(ws)
    sid = ws.sessions.open()

    async def go():
        slow = asyncio.ensure_future(a.sessions.run(sid, "sleep 0.2; echo done"))
        await asyncio.sleep(0.02)
        clones = await b.fork(1)  # another adapter: waits on the shared lock, not refused
        out = (await slow).output
        route = threading.Thread(target=lambda: _hold(workspace_locks(), ws, sid))
        route.start()
        await asyncio.sleep(0.02)
        more = await a.fork(1)  # waits for the route's call
        route.join()
        return out, clones + more

    out, clones = run(go())
    assert out == "done\n" and len(clones) == 2 and world.counts["fork"] == 2


def _hold(locks, ws, sid):
    with locks.held(ws):
        ws.sessions.run(sid, "sleep 0.2")


def test_cancelled_fork_removes_its_clones_and_holds_the_lock_until_done(world):
    world.fork_s = 0.1  # the fork takes 0.1 s * (1 + n)
    ws = world.create()
    aws = AsyncWorkspace(ws)

    async def go():
        fork = asyncio.ensure_future(aws.fork(3))
        await asyncio.sleep(0.05)  # the fork runs in its thread now
        fork.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fork
        t0 = time.monotonic()
        await aws.exec("echo after")  # waits for the cancelled fork's thread to finish
        return time.monotonic() - t0

    waited = run(go())
    assert waited > 0.2
    assert world.counts["fork"] == 1
    assert world.leftovers(keep=[ws.id]) == {}  # the 3 clones came back and were removed


def test_cancelled_restore_removes_what_it_made(world):
    world.fork_s = 0.05
    ws = world.create()
    asnap = AsyncSnapshot(ws.snapshot())

    async def go():
        task = asyncio.ensure_future(asnap.restore(2))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # the restore finishes in its thread, then is undone

    run(go())
    assert world.counts["restore"] == 2
    assert world.leftovers(keep=[ws.id, asnap.id]) == {}


def test_a_call_still_queued_when_cancelled_never_runs(world):
    bridge = ThreadBridge(1)
    ws = world.create()
    aws = AsyncWorkspace(ws, bridge=bridge)
    other = AsyncWorkspace(world.create(), bridge=bridge)

    async def go():
        sid = await other.sessions.open()
        busy = asyncio.ensure_future(other.sessions.run(sid, "sleep 0.2"))  # takes the one thread
        await asyncio.sleep(0.02)
        queued = asyncio.ensure_future(aws.fork(1))
        await asyncio.sleep(0.02)
        queued.cancel()
        await busy
        await asyncio.sleep(0.05)

    run(go())
    bridge.shutdown()
    assert world.counts["fork"] == 0
    assert sorted(world.live_workspaces) == sorted([ws.id, other.id])


def test_remove_without_waiting_kills_the_running_call(world):
    aws = AsyncWorkspace(world.create())

    async def go():
        sid = await aws.sessions.open()
        call = asyncio.ensure_future(aws.sessions.run(sid, "sleep 5"))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await aws.remove(wait=False)
        with pytest.raises(AgentError, match="removed during the call"):
            await call
        return time.monotonic() - t0

    assert run(go()) < 1.0
    assert world.leftovers() == {}


def test_errors_come_through_unchanged_and_free_the_lock(world):
    aws = AsyncWorkspace(world.create())

    async def go():
        with pytest.raises(InvalidArgument, match="unknown fork mode 'cheap'"):
            await aws.fork(1, mode="cheap")
        with pytest.raises(InvalidArgument, match="nice 40 is out of range"):
            await aws.set_cpu_priority(40)
        return await aws.exec("echo still usable")

    assert run(go()).stdout == "still usable\n"


def test_bridge_rejects_a_pool_of_no_threads():
    with pytest.raises(ValueError, match="max_threads must be >= 1"):
        ThreadBridge(0)


def test_bridge_grows_and_runs_calls_in_parallel():
    bridge = ThreadBridge(1)
    bridge.resize(4)
    assert bridge.max_threads == 4

    async def go():
        t0 = time.monotonic()
        await asyncio.gather(*(bridge.run_sync(time.sleep, 0.2) for _ in range(4)))
        return time.monotonic() - t0

    try:
        assert run(go()) < 0.6  # 4 x 0.2 s in parallel, not 0.8 s in a row
    finally:
        bridge.shutdown()


# --- the real runtime through the same adapter --------------------------------------


@pytest.mark.integration
@pytest.mark.criu
def test_real_workspace_fork_and_cancel_leave_nothing(family):
    """Made by ``await AsyncWorkspace.create`` (a local workspace, as ``AsyncClient.create`` makes
    remote ones); its fork returns the timings with the clones."""

    async def go():
        aws = await AsyncWorkspace.create("host", config=family.cfg, memory="1G")
        family.workspaces.append(aws.sync)
        sid = await aws.sessions.open("bash", cwd="/tmp")
        await aws.sessions.run(sid, "export K=forked; echo 1 > n")
        forks = await aws.fork(1)
        (clone,) = forks
        family.workspaces.append(clone.sync)
        t = forks.timings
        assert t.pause_ms > 0 and t.dump_ms > 0 and len(t.restore_ms) == 1 and t.restore_ms[0] > 0
        got = await clone.sessions.run(sid, 'echo "$K $(cat n)"', timeout=30)
        fork = asyncio.ensure_future(aws.fork(2))
        await asyncio.sleep(0.05)
        fork.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fork
        after = await aws.exec(["echo", "parent lives"])  # after the cancelled fork's thread
        await clone.remove()
        return got.output, after.stdout

    out, after = run(go())
    assert out.strip() == "forked 1"
    assert after == "parent lives\n"
    # the cancelled fork's clones were removed: the leak check (no_leaks) holds after ws goes
