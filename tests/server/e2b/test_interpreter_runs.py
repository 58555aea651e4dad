"""A sandbox streams at most MAX_RUNS code runs at once, and a finished or abandoned run frees its place."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio

from bunshin.server.e2b.interpreter import app


async def _lines(n: int) -> AsyncIterator[bytes]:
    for i in range(n):
        yield f"{i}\n".encode()


def test_runs_are_counted_while_they_stream_and_past_the_cap_none_starts() -> None:
    async def main() -> None:
        stream = app._counted("ws-a", _lines(3))
        assert await stream.__anext__() == b"0\n" and app._runs["ws-a"] == 1
        await stream.aclose()  # the caller hung up
        assert "ws-a" not in app._runs
        app._runs["ws-b"] = app.MAX_RUNS
        try:
            assert [x async for x in app._counted("ws-b", _lines(3))] == []
            assert app._runs["ws-b"] == app.MAX_RUNS
        finally:
            del app._runs["ws-b"]

    anyio.run(main)
