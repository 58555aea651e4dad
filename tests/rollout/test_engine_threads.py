"""The engine runs its blocking work in the one thread bridge, widened for its concurrency."""

from __future__ import annotations

import asyncio
import threading

from bunshin.rollout.engine import THREADS, RolloutEngine
from bunshin.rollout.policies import CallablePolicy
from bunshin.workspace.aio import default_bridge


def test_entering_an_engine_widens_the_bridge():
    bridge = default_bridge()

    async def go():
        async with RolloutEngine(concurrency=THREADS + 8):
            pass

    asyncio.run(go())
    assert bridge.max_threads >= 2 * (THREADS + 8)


def test_a_blocking_policy_runs_in_a_bridge_thread():
    seen: list[str] = []

    def policy(ctx):
        seen.append(threading.current_thread().name)
        return None

    async def go():
        return await CallablePolicy(policy).act(None)

    asyncio.run(go())
    assert seen and seen[0].startswith("bunshin")
    assert seen[0] != threading.main_thread().name
