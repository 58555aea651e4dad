"""The engine gives its loop one wide default executor for the blocking workspace calls."""

from __future__ import annotations

import asyncio
import threading

from bunshin.rollout.engine import ensure_threads


def test_one_pool_per_loop_kept_for_the_loop():
    async def go():
        ensure_threads(3)
        first = await asyncio.to_thread(lambda: threading.current_thread().name)
        ensure_threads(50)  # a later call leaves the loop's pool as it is
        names = set(await asyncio.gather(*(asyncio.to_thread(_slow_name) for _ in range(6))))
        return first, names

    first, names = asyncio.run(go())
    assert first.startswith("bunshin-rollout") and all(n.startswith("bunshin-rollout") for n in names)
    assert len(names) <= 3
    # a new loop gets its own pool (the old one was shut down with its loop)
    assert asyncio.run(_name_after_ensure()).startswith("bunshin-rollout")


def _slow_name() -> str:
    threading.Event().wait(0.05)
    return threading.current_thread().name


async def _name_after_ensure() -> str:
    ensure_threads(2)
    return await asyncio.to_thread(lambda: threading.current_thread().name)
