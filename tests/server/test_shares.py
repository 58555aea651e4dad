"""``Shares``: a sandbox's calls hold at most its share of the thread pool, the others wait
without a thread, past ``max_waiting`` they are refused (429); all sandboxes together hold at
most half the pool; a sandbox's share goes with its last call."""

from __future__ import annotations

import argparse
import threading

import anyio
import pytest

from bunshin.cli import serve_cmds
from bunshin.errors import RateLimited
from bunshin.server import shares
from bunshin.server.shares import Shares


def test_a_sandbox_holds_its_share_waits_then_is_refused_and_others_go_on() -> None:
    release = threading.Event()
    running: list[str] = []

    def blocked(name: str) -> str:
        running.append(name)
        release.wait(30)
        return name

    async def main() -> None:
        pool = Shares(threads=8, sandbox_threads=2, max_waiting=3)  # sandboxes: 4 threads together
        pool.start()
        assert anyio.to_thread.current_default_thread_limiter().total_tokens == 8
        done: list[str] = []

        async def call(sid: str, name: str, refuse: bool = True) -> None:
            done.append(await pool.run(sid, blocked, name, refuse=refuse))

        ended = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_release_at_end, release, ended)
            for i in range(5):  # 2 run, 3 wait
                tg.start_soon(call, "a", f"a{i}")
            await _until(lambda: len(running) == 2)
            with pytest.raises(RateLimited, match="sandbox a has 2 calls running and 3 waiting") as e:
                await pool.run("a", blocked, "a-too-many")
            assert e.value.details["retry_after"] > 0 and e.value.http_status == 429
            tg.start_soon(call, "a", "a-poll", False)  # a poll of a stream let in: waits its turn
            for i in range(3):  # b: its own 2 threads (the pool's 4 less a's 2), then it waits
                tg.start_soon(call, "b", f"b{i}")
            await _until(lambda: len(running) == 4)
            assert sorted(running) == ["a0", "a1", "b0", "b1"]
            assert len(pool) == 2
            ended.set()
        assert sorted(done) == sorted([*(f"a{i}" for i in range(5)), "a-poll", "b0", "b1", "b2"])
        assert len(pool) == 0  # the shares went with their last calls

    anyio.run(main)


def test_the_cli_defaults_are_the_servers() -> None:
    assert (serve_cmds.DEFAULT_THREADS, serve_cmds.DEFAULT_SANDBOX_THREADS) == (shares.THREADS, shares.SANDBOX_THREADS)
    parser = argparse.ArgumentParser()
    serve_cmds.register(parser.add_subparsers())
    helps = {a.dest: a.help for a in parser._subparsers._group_actions[0].choices["serve"]._actions}  # type: ignore[union-attr]
    assert f"past {shares.MAX_WAITING} waiting" in str(helps["sandbox_threads"])
    assert Shares(threads=4, sandbox_threads=8).per_sandbox == 2  # never more than the sandboxes' half


async def _release_at_end(release: threading.Event, ended: anyio.Event) -> None:
    """The blocked threads let go at the test's end, or at once when it fails (the group cancelled)."""
    try:
        await ended.wait()
    finally:
        release.set()


async def _until(ok) -> None:  # noqa: ANN001
    with anyio.fail_after(10):
        while not ok():
            await anyio.sleep(0.005)
