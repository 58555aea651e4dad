"""envd through the unmodified ``e2b`` SDK's async client, the whole way a user goes:
``AsyncSandbox.create(api_url=URL, sandbox_url=URL)`` against a real ``bunshin serve`` on
loopback, then commands, a PTY, files and a streamed watch (``WatchDir``); and a client
that hangs up leaves no follower or watch running on the server."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("e2b")

from e2b import AsyncSandbox, CommandExitException, PtySize, TimeoutException  # noqa: E402

from bunshin.server.e2b.envd.rpc import FOLLOWING, WATCHING  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import TOKEN, drop_everything  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def url(cfg) -> str:
    with serve_in_thread(cfg, TOKEN) as u:
        yield u
        drop_everything(u)
    assert leftovers(cfg) == {}


async def _settled(deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while (FOLLOWING.count or WATCHING.count) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def test_async_sdk_end_to_end(url: str) -> None:
    asyncio.run(_end_to_end(url))


async def _end_to_end(url: str) -> None:
    sbx = await AsyncSandbox.create(api_url=url, sandbox_url=url, api_key=TOKEN, envs={"FROM_CREATE": "yes"},
                                    timeout=300)
    try:
        r = await sbx.commands.run("echo $FROM_CREATE $MINE; echo e >&2", envs={"MINE": "mine"})
        assert (r.stdout, r.stderr) == ("yes mine\n", "e\n")
        with pytest.raises(CommandExitException):
            await sbx.commands.run("exit 7")
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 20", timeout=1)

        chunks: list[str] = []
        h = await sbx.commands.run("for i in 1 2 3; do echo n$i; sleep 0.05; done", background=True,
                                   on_stdout=chunks.append)
        assert (await h.wait()).exit_code == 0 and "".join(chunks) == "n1\nn2\nn3\n"

        events: list[tuple[str, str]] = []
        await sbx.files.make_dir("/w")
        watch = await sbx.files.watch_dir("/w", on_event=lambda e: events.append((e.name, e.type.value)))
        await sbx.files.write("/w/a.txt", b"\x00\x01bytes")
        assert bytes(await sbx.files.read("/w/a.txt", format="bytes")) == b"\x00\x01bytes"
        deadline = time.monotonic() + 10
        while ("a.txt", "create") not in events and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await watch.stop()
        assert ("a.txt", "create") in events

        screen = bytearray()
        term = await sbx.pty.create(PtySize(rows=30, cols=100), on_data=screen.extend)
        await sbx.pty.send_stdin(term.pid, b"echo SZ:$(stty size)\n")
        deadline = time.monotonic() + 15
        while b"SZ:30 100" not in screen and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert b"SZ:30 100" in screen
        assert await sbx.pty.kill(term.pid)
        with pytest.raises(CommandExitException):
            await term.wait()

        # hang-ups: a follower and a watch whose clients go away end on the server
        await _settled()
        assert (FOLLOWING.count, WATCHING.count) == (0, 0)
        quiet = await sbx.commands.run("sleep 60", background=True)
        watch = await sbx.files.watch_dir("/w", on_event=lambda e: None)
        deadline = time.monotonic() + 5
        while (FOLLOWING.count, WATCHING.count) != (1, 1) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert (FOLLOWING.count, WATCHING.count) == (1, 1)
        await quiet.disconnect()
        await watch.stop()
        await _settled()
        assert (FOLLOWING.count, WATCHING.count) == (0, 0)
        assert quiet.pid in {p.pid for p in await sbx.commands.list()}  # the command itself goes on
        await sbx.commands.kill(quiet.pid)
    finally:
        await sbx.kill()
