"""The agent's waiting threads end before a fork's freeze (``agent_trim``): CRIU's -v4 log of
the dump seizes none of them, the parent and the clone start threads again at their next
calls and answer them, and an agent that cannot be reached is forked as it is."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import pytest

from bunshin.runtime.agent_host import trim as agent_trim
from bunshin.runtime.snapshot import taking as snapshot_taking
from bunshin.tools import ToolSet

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _threads(ws) -> int:
    return len(os.listdir(f"/proc/{ws.record.pid}/task"))


def _until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def _seized_threads(snap) -> int:
    log = (Path(snap.record.images) / "dump.log").read_text(errors="replace")
    return len(re.findall(r"Seizing \d+'s \d+ thread", log))


def test_a_fork_dumps_no_waiting_thread_and_both_sides_start_them_again(family):
    family.cfg = dataclasses.replace(family.cfg, dump_log_level=4)  # CRIU names each thread it seizes
    ws = family.create()
    ws.exec(["true"])  # an exec runs on two threads of the pool (its connection's and its job's)
    ToolSet.default().run_sync(ws, "bash", {"command": "cd /tmp"})  # a session: its reader thread stays
    time.sleep(0.2)  # the calls' threads back to waiting (one still ending its call counts as staying)
    busy = _threads(ws)
    left = agent_trim.before_freeze(ws.record)
    assert left is not None and left < busy  # the pool's threads were waiting, and end
    assert _until(lambda: _threads(ws) <= left)  # (the host waits for it too, at most WAIT_S)
    ws.exec(["true"])  # starts threads again, which wait once the call is done
    assert _threads(ws) > left
    snap = family.snapshot(ws)
    assert _seized_threads(snap) == 2  # the reaper and the session's reader: none of the pool's
    assert _threads(ws) == left
    assert ws.exec(["echo", "parent"]).stdout == "parent\n"
    (clone,) = family.restore(snap, 1)
    assert _threads(clone) == left
    assert clone.exec(["echo", "clone"]).stdout == "clone\n"
    assert _threads(clone) > left  # the clone's call started threads of its own


def test_an_agent_that_cannot_be_reached_is_forked_as_it_is(family, monkeypatch):
    ws = family.create()
    ws.exec(["true"])
    gone = dataclasses.replace(ws.record, root=str(Path(ws.record.root) / "no-such-folder"))
    assert agent_trim.before_freeze(gone) is None  # refused at the walk to the socket: no error
    assert agent_trim.before_freeze(dataclasses.replace(ws.record, pid=None)) is None
    calls: list[int | None] = []
    monkeypatch.setattr(snapshot_taking, "trim_agent", lambda rec: calls.append(agent_trim.before_freeze(gone)))
    threads = _threads(ws)
    snap = family.snapshot(ws)  # forked with its waiting threads
    assert calls == [None] and _threads(ws) == threads
    (clone,) = family.restore(snap, 1)
    assert clone.exec(["echo", "ok"]).stdout == "ok\n"
