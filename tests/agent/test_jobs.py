"""Resumable calls: exec and session_run as agent jobs polled over short connections."""

from __future__ import annotations

import threading
import time

import pytest

from bunshin.errors import InvalidArgument, NotFound
from bunshin.runtime.agent_host.client import POLL_S, AgentClient, quiesced


def test_long_exec_is_polled_and_answers(client: AgentClient):
    t0 = time.monotonic()
    r = client.exec(cmd=f"sleep {POLL_S * 3}; echo done")
    assert r.stdout == "done\n" and r.exit_code == 0
    assert time.monotonic() - t0 >= POLL_S * 3


def test_job_errors(client: AgentClient):
    with pytest.raises(InvalidArgument):
        client.call("job_start", request={"op": "read_file", "path": "/"})
    with pytest.raises(NotFound):
        client.call("job_wait", job_id="nope", wait=0)
    job = client.call("job_start", request={"op": "exec", "argv": ["true"]})
    client.call("job_wait", job_id=job["job_id"], wait=5)
    with pytest.raises(NotFound):  # an answer is fetched once
        client.call("job_wait", job_id=job["job_id"], wait=0)


def test_errors_of_the_inner_call_come_back(client: AgentClient):
    with pytest.raises(NotFound):
        client.session_run("no-such-session", "true")


def test_quiesce_waits_for_in_flight_calls_and_holds_new_ones(agent, tmp_path):
    """While ``quiesced`` is held no connection is open; calls resume after it."""
    c = AgentClient(agent.socket, lock_dir=tmp_path)
    results: list[str] = []
    worker = threading.Thread(target=lambda: results.append(c.exec(cmd="sleep 1; echo finished").stdout))
    worker.start()
    time.sleep(0.3)
    with quiesced(tmp_path):
        held_at = time.monotonic()
        assert not results
        blocked: list[float] = []
        other = threading.Thread(target=lambda: (c.ping(), blocked.append(time.monotonic())))
        other.start()
        time.sleep(1.2)  # the exec finishes inside the agent meanwhile, but its answer waits
        assert not results and not blocked
    other.join(5)
    worker.join(5)
    assert results == ["finished\n"] and blocked and blocked[0] >= held_at + 1.2
