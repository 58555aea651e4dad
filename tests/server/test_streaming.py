"""Streaming exec over real HTTP: output arrives while the command runs; timeouts and
callers that leave kill the command; nothing is left in the workspace."""

from __future__ import annotations

import time

import pytest

from bunshin import WorkspaceNotFound

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_output_comes_as_it_is_written(served):
    with served.client() as c, c.create(memory="512M") as ws:
        t0 = time.monotonic()
        seen: list[tuple[float, dict]] = []
        for event in ws.commands.stream("echo a; sleep 0.8; echo b >&2; exit 4", timeout=30, cwd="/tmp"):
            seen.append((time.monotonic() - t0, event))
        chunks = [e for _, e in seen if "stream" in e]
        assert "".join(e["data"] for e in chunks if e["stream"] == "stdout") == "a\n"
        assert "".join(e["data"] for e in chunks if e["stream"] == "stderr") == "b\n"
        first_out = next(t for t, e in seen if e.get("stream") == "stdout")
        end_t, end = seen[-1]
        assert end["exit_code"] == 4 and end["timed_out"] is False
        assert end_t - first_out > 0.5  # 'a' arrived before the command ended
        assert ws.exec("ls -A /tmp/.bunshin-stream", timeout=30).stdout == ""  # its files are gone


def test_a_timeout_kills_the_command(served):
    with served.client() as c, c.create(memory="512M") as ws:
        t0 = time.monotonic()
        *_, end = ws.commands.stream("echo started; sleep 30", timeout=1)
        assert end["timed_out"] is True and end["exit_code"] == -9
        assert time.monotonic() - t0 < 10
        assert "sleep 30" not in " ".join(" ".join(p.cmdline) for p in ws.processes())


def test_leaving_the_stream_early_kills_the_command(served):
    with served.client() as c, c.create(memory="512M") as ws:
        events = ws.commands.stream("echo go; sleep 30", timeout=60)
        assert next(events)["data"] == "go\n"
        events.close()  # the caller goes away mid-stream
        deadline = time.monotonic() + 10
        while "sleep 30" in " ".join(" ".join(p.cmdline) for p in ws.processes()):
            assert time.monotonic() < deadline, "the command outlived its caller"
            time.sleep(0.1)


def test_a_missing_workspace_is_a_404_before_any_stream(served):
    with served.client() as c:
        ws = c.create(memory="512M")
        ws.remove()
        with pytest.raises(WorkspaceNotFound):
            list(ws.commands.stream("true"))


def test_big_output_arrives_whole_in_pieces_and_a_planted_status_is_read_bounded(served):
    """20 MiB of output arrives whole, a few MiB per poll (the server holds no more between two
    sends); a command that plants a 1 GiB sparse file as its own status file ends the stream
    with what 64 bytes of it say (-1: its own lie), not with the server reading the file."""
    with served.client() as c, c.create(memory="512M") as ws:
        events = list(ws.commands.stream("head -c 20971520 /dev/zero | tr '\\0' y; echo", timeout=120))
        out = [e["data"] for e in events if e.get("stream") == "stdout"]
        assert sum(map(len, out)) == 20971521 and max(map(len, out)) <= 1 << 20 and events[-1]["exit_code"] == 0
        lie = "for o in /tmp/.bunshin-stream/*.out; do truncate -s 1G \"${o%.out}.rc\"; done; echo lied; sleep 30"
        t0 = time.monotonic()
        *_, end = ws.commands.stream(lie, timeout=60)
        assert end["exit_code"] == -1 and not end["timed_out"] and time.monotonic() - t0 < 20, end
        assert ws.exec("echo alive", timeout=30).stdout == "alive\n"  # the workspace (and the server) serve on
