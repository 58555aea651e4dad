"""Speculative execution through the prefix cache, over the fake workspace."""

from __future__ import annotations

import asyncio
import time

import pytest

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.speculate import SpeculationPolicy
from bunshin.testing import FakeWorld
from bunshin.tools import ToolSet
from tests.fakes import WORKDIR, fake_root, run

TEST = ("bash", {"command": "sleep 0.2; cat a; echo tested"})


@pytest.fixture
def world() -> FakeWorld:
    return FakeWorld(fork_s=0.005)


@pytest.fixture
def root(world):
    return fake_root(world)


def cache_with(**kw) -> PrefixCache:
    policy = SpeculationPolicy(**{"min_expected_s": 0.05, "think_aware": False, **kw})
    return PrefixCache(ToolSet.default(workdir=WORKDIR), policy=CachePolicy(snapshot_min_s=10), speculation=policy)


async def teach(cache, root):
    """One trajectory that edits, then runs the tests: what follows an edit."""
    traj = cache.start(root)
    await traj.call("write_file", {"path": "a", "content": "first"})
    await traj.call(*TEST)
    await traj.close()


def test_a_speculation_hides_the_call_and_hands_over_its_fork(world, root):
    async def go():
        cache = cache_with()
        await teach(cache, root)
        traj = cache.start(root)
        await traj.call("write_file", {"path": "a", "content": "second"})  # a new edit: a miss
        await asyncio.sleep(0.4)  # the policy thinks; the tests run meanwhile
        runs = world.counts["run"]
        obs = await traj.call(*TEST)
        assert obs.output == "secondtested\n" and obs.cached and obs.speculated
        assert obs.duration_s < 0.2  # served: the command alone sleeps 0.2 s
        assert world.counts["run"] == runs  # nothing ran for the real call
        after = await traj.call("bash", {"command": "cat a"})  # in the adopted fork, no replay
        assert after.output == "second" and traj.stats.replayed == 0
        st = cache.stats().speculation
        assert st.started >= 1 and st.used == 1 and st.hidden_s > 0.15
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_real_call_waits_for_the_running_speculation(world, root):
    async def go():
        cache = cache_with()
        await teach(cache, root)
        traj = cache.start(root)
        await traj.call("write_file", {"path": "a", "content": "third"})
        await asyncio.sleep(0.1)  # the speculation is half way
        runs = world.counts["run"]
        obs = await traj.call(*TEST)
        assert obs.output == "thirdtested\n" and obs.speculated
        assert world.counts["run"] - runs <= 1  # not started over (at most the cat above ran)
        st = cache.stats().speculation
        assert st.used == 1 and 0 < st.hidden_s < 0.2
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_speculation_nobody_needs_is_cancelled(world, root):
    async def go():
        cache = cache_with()
        await teach(cache, root)
        traj = cache.start(root)
        runs = world.counts.get("run", 0)
        await traj.call("write_file", {"path": "a", "content": "x"})
        deadline = time.monotonic() + 10  # its call begun in its fork (a cancel before that wastes no CPU)
        while world.counts.get("run", 0) == runs:
            assert time.monotonic() < deadline, "the speculation never began its call"
            await asyncio.sleep(0.01)
        obs = await traj.call("bash", {"command": "echo other"})
        assert obs.output == "other\n"
        await asyncio.sleep(0.05)
        st = cache.stats().speculation
        assert st.cancelled == 1 and st.used == 0 and st.wasted_cpu_s > 0
        # its fork is gone: only the trajectory's own workspace is alive
        assert len(world.live_workspaces) == 1
        node = traj.node.parent
        assert TEST not in [(c.call.name, c.call.arguments) for c in node.children.values()]
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_a_finished_unused_speculation_keeps_its_result_but_not_its_fork(world, root):
    async def go():
        cache = cache_with()
        await teach(cache, root)
        traj = cache.start(root)
        await traj.call("write_file", {"path": "a", "content": "y"})
        await asyncio.sleep(0.4)  # finished and parked
        assert len(world.live_workspaces) == 2
        await traj.call("bash", {"command": "echo other"})
        await asyncio.sleep(0.05)
        assert len(world.live_workspaces) == 1
        st = cache.stats().speculation
        assert st.used == 0 and st.wasted_cpu_s >= 0.2
        # the result stays in the tree: another trajectory gets it for free
        other = cache.start(root)
        await other.call("write_file", {"path": "a", "content": "y"})
        obs = await other.call(*TEST)
        assert obs.cached and obs.output == "ytested\n"
        await other.close()
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_the_budget_limits_concurrent_speculations(world, root):
    async def go():
        cache = cache_with(max_concurrent=1, top_k=2)
        t = cache.start(root)
        await t.call("write_file", {"path": "a", "content": "1"})
        await t.call("bash", {"command": "sleep 0.1; echo one"})
        await t.close()
        t = cache.start(root)
        await t.call("write_file", {"path": "a", "content": "2"})
        await t.call("bash", {"command": "sleep 0.1; echo two"})
        await t.close()
        await asyncio.sleep(0.2)  # what the teaching runs started is over
        before = cache.stats().speculation
        traj = cache.start(root)
        await traj.call("write_file", {"path": "a", "content": "3"})  # two candidates, room for one
        st = cache.stats().speculation
        assert st.started - before.started == 1 and st.skipped_budget > before.skipped_budget
        await traj.close()
        await cache.aclose()

    run(go())
    assert world.leftovers(keep=[root.id]) == {}


def test_cheap_calls_are_not_worth_a_fork(world, root):
    async def go():
        cache = cache_with(min_expected_s=1.0)
        await teach(cache, root)
        traj = cache.start(root)
        await traj.call("write_file", {"path": "a", "content": "z"})
        assert cache.stats().speculation.started == 0
        await traj.close()
        await cache.aclose()

    run(go())


def test_no_speculation_when_the_policy_answers_faster_than_a_fork(world, root):
    async def go():
        cache = cache_with(think_aware=True)
        for content in ("p", "q"):  # back to back: no think time at all
            t = cache.start(root)
            await t.call("write_file", {"path": "a", "content": content})
            await t.call(*TEST)
            await t.close()
        st = cache.stats().speculation
        assert st.skipped_think > 0 and st.started == 0
        await cache.aclose()

    run(go())
