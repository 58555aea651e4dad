"""The agent's waiting threads ended just before a fork's freeze (issue 17, the delta pause).

CRIU seizes every thread of the dumped tree inside the pause and dumps each one
(registers, signal mask, cgroups: a round trip to its parasite); the agent's pool threads
waiting for calls were 3 of its 6 (``bench delta-pause`` at load 3-8: p50 7.32 -> 6.78 ms,
p90 11.09 -> 9.85 ms, 240 dumps each). ``before_freeze``
asks the agent to end them (``trim``: the thread answering ends too, once the host has
hung up) and waits, at most ``WAIT_S``, until ``/proc`` shows they are gone. The parent and
its clones start threads again at their next calls.

Called inside ``quiesced`` (no host call is in flight, none can start): the connection
takes no call lock. Best effort: an agent that cannot answer in ``TIMEOUT_S`` (busy, at
its pids limit, an older agent without the op) is forked with its threads, as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ...errors import BunshinError
from ..state.records import WorkspaceRecord
from .bundle import AgentBundle
from .client import AgentClient

#: Longest the host waits for the agent's answer, then for its threads to be gone.
TIMEOUT_S = 0.5
WAIT_S = 0.2  # normally < 1 ms; a loaded machine may take a while to run the threads to their end


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0  # gone: nothing to wait for


def before_freeze(rec: WorkspaceRecord) -> int | None:
    """End the waiting threads of the agent of ``rec`` (its pid 1); the agent's thread count
    once they are gone, or ``None`` if it did not answer (nothing was waited for)."""
    if not rec.pid:
        return None
    client = AgentClient(Path(rec.root) / AgentBundle.SOCKET.lstrip("/"), beneath=Path(rec.root),
                         expect_pid=rec.pid, connect_timeout=TIMEOUT_S, call_timeout=TIMEOUT_S)
    try:
        threads = client.trim()
    except (BunshinError, OSError):
        return None
    deadline = time.monotonic() + WAIT_S
    while _threads(rec.pid) > threads and time.monotonic() < deadline:
        time.sleep(0.0002)
    return threads
