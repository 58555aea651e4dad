"""The prefix cache's logic over the in-memory fake workspace (fast, no root needed)."""

from __future__ import annotations

import asyncio

import pytest

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.testing import FakeSnapshot, FakeWorld
from bunshin.tools import ToolSet, command_tool
from tests.fakes import WORKDIR, fake_root, run, state_of


@pytest.fixture
def world() -> FakeWorld:
    return FakeWorld()


@pytest.fixture
def root(world):
    return fake_root(world)


def tools() -> ToolSet:
    ts = ToolSet.default(workdir=WORKDIR)
    ts.add(command_tool("now", "random", deterministic=False, read_only=True))
    ts.add(command_tool("roll", "random; write /w/roll x", deterministic=False))
    return ts


def bash(cmd: str) -> tuple[str, dict]:
    return "bash", {"command": cmd}


def make(policy: CachePolicy | None = None) -> PrefixCache:
    return PrefixCache(tools(), policy=policy or CachePolicy(snapshot_min_s=10, shared_min_replay_s=10))


async def walk(cache, root, calls, *, close=True):
    traj = cache.start(root)
    obs = [await traj.call(n, a) for n, a in calls]
    if close:
        await traj.close()
    return traj, obs


def direct(world, root, calls):
    """The same calls without any cache: a fresh restore, every call run."""
    ts = tools()
    (ws,) = root.restore(1)
    try:
        return [ts.run_sync(ws, n, a) for n, a in calls], state_of(ws)
    finally:
        ws.remove()


def test_repeated_calls_hit_without_a_workspace(world, root):
    calls = [bash("write a 1"), bash("cat a"), ("read_file", {"path": "a"}), bash("export X=2; echo $X")]

    async def go():
        cache = make()
        _, first = await walk(cache, root, calls)
        restores, runs = world.counts["restore"], world.counts["run"]
        traj, second = await walk(cache, root, calls)
        assert world.counts["restore"] == restores and world.counts["run"] == runs  # purely virtual
        assert [o.output for o in second] == [o.output for o in first]
        assert all(o.cached for o in second) and not any(o.cached for o in first)
        assert traj.stats.hits == 4 and traj.stats.materialisations == 0
        st = cache.stats()
        assert (st.hits, st.misses, st.hit_rate) == (4, 4, 0.5)
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_miss_forks_the_deepest_snapshot_and_replays_only_the_rest(world, root):
    prefix = [bash("write a 1"), bash("sleep 0.05; write b 2"), bash("write c 3"), ("read_file", {"path": "c"})]

    async def go():
        cache = make(CachePolicy(snapshot_min_s=0.04, shared_min_replay_s=10))
        await walk(cache, root, prefix)
        assert cache.stats().snapshots == 1  # after the slow call only
        traj, obs = await walk(cache, root, [*prefix, bash("cat a; cat b; cat c")], close=False)
        assert obs[-1].output == "1\n2\n3\n" and not obs[-1].cached
        # restored from the snapshot after the slow call; replayed "write c" only (read_file needs no replay)
        assert traj.stats.materialisations == 1 and traj.stats.replayed == 1
        ws = (await traj.workspace()).sync
        assert ws.files.read("/w/c") == b"3\n"
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_lagging_workspace_catches_up_before_the_next_miss(world, root):
    async def go():
        cache = make()
        await walk(cache, root, [bash("write a 1"), bash("inc n"), bash("inc n")])
        # this one misses first, then hits the two incs, then misses again
        traj, obs = await walk(cache, root, [bash("write z 0"), bash("cat z")], close=False)
        traj2 = cache.start(root)
        await traj2.call(*bash("write a 1"))
        o1 = await traj2.call(*bash("inc n"))
        o2 = await traj2.call(*bash("inc n"))
        assert (o1.cached, o2.cached) == (True, True)
        o3 = await traj2.call(*bash("cat n"))
        assert o3.output == "2" and not o3.cached
        assert traj2.stats.replayed == 3  # "write a", "inc n", "inc n" into a fork of the root
        await traj2.close()
        await traj.close()
        await cache.aclose()

    run(go())


def test_concurrent_identical_calls_run_once(world, root):
    async def go():
        cache = make()
        before = world.counts["run"]
        results = await asyncio.gather(*(walk(cache, root, [bash("sleep 0.05; inc n")]) for _ in range(5)))
        assert world.counts["run"] - before == 1
        assert {r[1][0].output for r in results} == {"1\n"}
        assert sum(r[1][0].cached for r in results) == 4
        await cache.aclose()

    run(go())


def test_nondeterministic_tools_are_never_cached(world, root):
    async def go():
        cache = make()
        t1, o1 = await walk(cache, root, [bash("write a 1"), ("now", {}), bash("cat a")], close=False)
        assert t1.on_tree  # a read-only non-deterministic call runs, but the state is still the node's
        t2, o2 = await walk(cache, root, [bash("write a 1"), ("now", {}), bash("cat a")], close=False)
        assert not o2[1].cached and o2[1].output != o1[1].output and o2[2].cached
        t3, o3 = await walk(cache, root, [bash("write a 1"), ("roll", {}), bash("cat roll")], close=False)
        assert not t3.on_tree and not o3[2].cached and o3[2].output == "x\n"  # off the tree after a state change
        for t in (t1, t2, t3):
            await t.close()
        await cache.aclose()

    run(go())


def test_timed_out_calls_are_not_cached(world, root):
    ts = tools()
    ts.add(command_tool("slow", "sleep 5", timeout=0.05, session=True))

    async def go():
        cache = PrefixCache(ts)
        t1, o1 = await walk(cache, root, [("slow", {})], close=False)
        assert o1[0].timed_out and not t1.on_tree
        t2, o2 = await walk(cache, root, [("slow", {})])
        assert o2[0].timed_out and not o2[0].cached
        await t1.close()
        await cache.aclose()

    run(go())


def test_invalid_arguments_give_an_error_and_leave_the_tree_alone(world, root):
    async def go():
        cache = make()
        traj, obs = await walk(cache, root, [("edit", {"path": "x"}), ("nosuch", {}), bash("echo ok")])
        assert "missing required 'old_str'" in obs[0].error and "unknown tool" in obs[1].error
        assert obs[2].output == "ok\n" and traj.stats.invalid == 2
        assert cache.stats().nodes == 1 and len(traj.history) == 3
        await cache.aclose()

    run(go())


def test_tool_errors_are_cached_like_results(world, root):
    async def go():
        cache = make()
        calls = [("edit", {"path": "missing.py", "old_str": "a", "new_str": "b"})]
        _, o1 = await walk(cache, root, calls)
        _, o2 = await walk(cache, root, calls)
        assert "no such file" in o1[0].error and o2[0].cached and o2[0].error == o1[0].error
        await cache.aclose()

    run(go())


def test_snapshot_at_a_node_two_trajectories_reached(world, root):
    async def go():
        cache = make(CachePolicy(snapshot_min_s=10, shared_min_replay_s=0.0))
        prefix = [bash("write a 1"), bash("write b 2")]
        t1, _ = await walk(cache, root, prefix, close=False)  # t1's workspace waits at the node
        t2, _ = await walk(cache, root, prefix, close=False)  # the second visit: snapshot it
        await asyncio.sleep(0.05)
        assert cache.stats().snapshots == 1
        node = t2.node
        assert node.snapshot is not None and t2.stats.materialisations == 0
        t3, obs = await walk(cache, root, [*prefix, bash("cat a")], close=False)
        assert obs[-1].output == "1\n" and t3.stats.replayed == 0  # straight from the shared snapshot
        for t in (t1, t2, t3):
            await t.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_eviction_keeps_the_budget_and_results_stay_right(world, root):
    async def go():
        cache = make(CachePolicy(snapshot_min_s=0.0, shared_min_replay_s=10, memory_budget_bytes=12_000))
        for i in range(6):
            await walk(cache, root, [bash(f"write f{i} {'x' * 1500}"), bash(f"sleep 0.0{i}; write g{i} y")])
        await asyncio.sleep(0.05)
        st = cache.stats()
        assert st.evictions > 0 and st.bytes_held <= 12_000
        for i in range(6):
            calls = [bash(f"write f{i} {'x' * 1500}"), bash(f"sleep 0.0{i}; write g{i} y"), bash(f"cat g{i}")]
            _, obs = await walk(cache, root, calls)
            assert obs[-1].output == "y\n"
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_save_and_load_with_snapshots(world, root, tmp_path):
    calls = [bash("write a 1"), bash("sleep 0.03; export V=7"), bash("write b 2")]

    async def go():
        cache = make(CachePolicy(snapshot_min_s=0.02, shared_min_replay_s=10))
        await walk(cache, root, calls)
        await asyncio.sleep(0.02)
        cache.save(tmp_path)
        await cache.aclose(keep_snapshots=True)
        assert len(world.snapshots) == 2  # the root and the one after the slow call

        loaded = PrefixCache.load(tmp_path, tools(), resolve=lambda i: FakeSnapshot.get(i, world=world))
        assert loaded.roots() == {root.id: root}
        runs = world.counts["run"]
        traj, obs = await walk(loaded, root, [*calls, bash("echo $V; cat b")], close=False)
        assert all(o.cached for o in obs[:3]) and obs[3].output == "7\n2\n"
        assert traj.stats.replayed == 1 and world.counts["run"] - runs == 2  # "write b", then the new call
        await traj.close()
        await loaded.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_diverging_replay_is_detected(world, root):
    async def go():
        cache = make()
        await walk(cache, root, [bash("random")])  # wrongly deterministic: the cache believes it
        traj, obs = await walk(cache, root, [bash("random"), bash("write a 1")], close=False)
        assert obs[0].cached and not traj.on_tree
        assert cache.stats().divergences == 1
        await traj.close()
        await cache.aclose()

    run(go())


def test_workspace_materialises_and_leaves_the_tree(world, root):
    async def go():
        cache = make()
        calls = [bash("write a 1"), bash("export K=v")]
        await walk(cache, root, calls)
        traj, _ = await walk(cache, root, calls, close=False)
        ws = (await traj.workspace()).sync
        assert ws.files.read("/w/a") == b"1\n" and not traj.on_tree
        _, expected = direct(world, root, calls)
        assert state_of(ws) == expected
        o = await traj.call(*bash("echo $K"))
        assert o.output == "v\n" and not o.cached
        await traj.close()
        assert not ws.alive
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_closed_trajectory_refuses_calls(world, root):
    async def go():
        cache = make()
        traj = cache.start(root)
        await traj.close()
        with pytest.raises(Exception, match="closed"):
            await traj.call(*bash("echo"))
        await cache.aclose()

    run(go())
