"""Integration: a loopback TCP stream with data in flight inside a workspace, forked.

CRIU restores a connected TCP socket in repair mode, which needs CAP_NET_ADMIN over
the clone's network namespace; a workspace's tasks run in its own user namespace and
the network namespace is the host's, so the restore would fail ("Can't turn TCP
repair mode ON"). The fork is refused before the parent is frozen, and the stream
in the parent goes on: every byte once, in order (tests/workspace/progs/tcpstream.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bunshin.errors import NotForkable

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROG = Path(__file__).parent / "progs" / "tcpstream.py"
TOTAL = 6_000_000  # ~2 s at the reader's pace


def _wait_for(ws, path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while ws.exec(["test", "-e", path]).exit_code != 0:
        assert time.monotonic() < deadline, f"{path} did not appear in {ws.id}"
        time.sleep(0.05)


def _queues(ws) -> list[tuple[int, int]]:
    """(send queue, receive queue) bytes of each connected socket in the workspace."""
    out = []
    for line in ws.files.read_text("/proc/net/tcp").splitlines()[1:]:
        f = line.split()
        if f[3] == "01":
            tx, rx = f[4].split(":")
            out.append((int(tx, 16), int(rx, 16)))
    return out


def test_a_stream_in_flight_is_refused_and_goes_on_in_the_parent(family):
    ws = family.create(memory="512M")
    ws.files.write("/root/tcpstream.py", PROG.read_bytes())
    ws.exec(["mkdir", "-p", "/tmp/ts"])
    ws.commands.spawn(["python3", "/root/tcpstream.py", str(TOTAL), "/tmp/ts"])
    _wait_for(ws, "/tmp/ts/progress")
    queues = _queues(ws)
    assert any(tx > 0 for tx, _ in queues) and any(rx > 0 for _, rx in queues), queues  # data in flight
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 2)
    err = info.value
    assert "TCP connection 127.0.0.1:" in err.message and "ESTABLISHED" in err.message
    holders = {int(p) for p in ws.exec(["pgrep", "-f", "tcpstream.py"]).stdout.split()}  # server and client
    assert "tcpstream.py" in err.details["command"] and err.details["process"] in holders
    assert f"process {err.details['process']} (" in err.message
    assert "close TCP connections before forking" in (err.hint or "")
    assert not any(family.cfg.paths.snapshots.glob("*")), "nothing is dumped"
    _wait_for(ws, "/tmp/ts/result")
    result = json.loads(ws.files.read_text("/tmp/ts/result"))
    assert result == {**result, "ok": True, "bytes": TOTAL, "error": None}
    # the connection is gone: the same workspace forks, and the clone has the result
    (clone,) = family.fork(ws, 1)
    assert json.loads(clone.files.read_text("/tmp/ts/result")) == result
