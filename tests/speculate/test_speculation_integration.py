"""Speculative execution on the real runtime: used, waited for, cancelled; niceness restored."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.runtime.state.store import Store
from bunshin.speculate import SpeculationPolicy
from bunshin.tools import ToolSet
from tests.cache.conftest import TASK_DIR

pytestmark = [pytest.mark.integration, pytest.mark.criu]

TESTS = ("bash", {"command": "sleep 0.6; cat a.txt; echo passed"})


def live_workspaces(cfg) -> int:
    with Store.open(cfg.db_path) as store:
        return len(store.list_workspaces())


def cache() -> PrefixCache:
    return PrefixCache(ToolSet.default(workdir=TASK_DIR), policy=CachePolicy(snapshot_min_s=5),
                       speculation=SpeculationPolicy(min_expected_s=0.1, think_aware=False))


async def teach(c: PrefixCache, root, tests: tuple = TESTS) -> None:
    t = c.start(root)
    await t.call("write_file", {"path": "a.txt", "content": "v1\n"})
    await t.call(*tests)
    await t.close()


async def until(cond, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out waiting")


def test_speculation_is_used_and_hands_over_its_fork(real_root):
    root = real_root.snapshot

    async def go():
        c = cache()
        try:
            await teach(c, root)
            traj = c.start(root)
            await traj.call("write_file", {"path": "a.txt", "content": "v2\n"})
            await asyncio.sleep(1.5)  # the policy "thinks": the tests run in a fork meanwhile
            obs = await traj.call(*TESTS)
            assert obs.output == "v2\npassed\n" and obs.exit_code == 0
            # served, not run again: the command alone sleeps 0.6 s (a bound, not a timing)
            assert obs.cached and obs.speculated and obs.duration_s < 0.6
            ws = (await traj.workspace()).sync  # the speculation's fork, adopted: nothing replayed
            assert traj.stats.replayed == 0
            nice = ws.exec("for d in /proc/[0-9]*; do read -r l < $d/stat; set -- ${l##*) }; echo ${17}; done")
            assert set(nice.stdout.split()) == {"0"}  # no process reniced (the cgroup is)
            cpu = next((Path(p) for k, p in ws.record.cgroups if k == "cpu"), None)
            if cpu is not None and (cpu / "cpu.shares").exists():
                assert (cpu / "cpu.shares").read_text().strip() == "1024"  # priority put back
            st = c.stats().speculation
            assert st.used == 1 and st.hidden_s > 0.5
            await traj.close()
        finally:
            await c.aclose()

    asyncio.run(go())


def test_a_real_call_waits_for_a_running_speculation(real_root):
    root = real_root.snapshot

    async def go():
        c = cache()
        try:
            await teach(c, root)
            traj = c.start(root)
            await traj.call("write_file", {"path": "a.txt", "content": "v3\n"})
            await asyncio.sleep(0.5)
            obs = await traj.call(*TESTS)
            assert obs.output == "v3\npassed\n" and obs.speculated
            st = c.stats().speculation
            assert st.used == 1 and 0 < st.hidden_s < 0.6
            await traj.close()
        finally:
            await c.aclose()

    asyncio.run(go())


def test_an_unneeded_speculation_is_cancelled_and_its_fork_removed(real_root):
    root, cfg = real_root.snapshot, real_root.cfg

    async def go():
        c = cache()
        try:
            await teach(c, root, ("bash", {"command": "sleep 2; echo long"}))
            traj = c.start(root)
            await traj.call("write_file", {"path": "a.txt", "content": "v4\n"})
            await until(lambda: live_workspaces(cfg) == 2)  # the fork is up, running the command
            await asyncio.sleep(0.3)
            obs = await traj.call("bash", {"command": "cat a.txt"})
            assert obs.output == "v4\n"
            await until(lambda: live_workspaces(cfg) == 1)  # only the trajectory's own is left
            st = c.stats().speculation
            assert st.cancelled == 1 and st.used == 0 and st.wasted_cpu_s > 0
            await traj.close()
        finally:
            await c.aclose()

    asyncio.run(go())
