"""OpenEnv: openenv-core's own server app over bunshin episodes, driven by openenv-core's own clients
(the typed EnvClient subclass and GenericEnvClient) over real WebSocket and HTTP on loopback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from openenv.core.generic_client import GenericEnvClient

from bunshin.adapters.openenv import BunshinAction, BunshinEnvClient, create_app
from bunshin.server.thread import listening_socket

from .conftest import TASK

pytestmark = [pytest.mark.integration, pytest.mark.criu]


@contextmanager
def openenv_server(**kw) -> Iterator[str]:
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(TASK, **kw), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the OpenEnv server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def test_sessions_fork_one_root_through_openenvs_clients(home):
    with openenv_server(config=home) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "healthy"
        with BunshinEnvClient(base_url=url).sync() as a, GenericEnvClient(base_url=url).sync() as b:
            ra = a.reset()
            assert ra.observation.prompt == "write the score" and not ra.done
            rb = b.reset()
            assert rb.observation["tools"] == ["bash", "read_file", "write_file"]
            oa = a.step(BunshinAction(tool="bash", arguments={"command": "cat setup.id; echo 0.5 > score"}))
            ob = b.step({"tool": "bash", "arguments": {"command": "cat setup.id; ls"}})
            assert oa.observation.output.split()[0] == ob.observation["output"].split()[0]  # one root
            assert "score" not in ob.observation["output"]  # its own fork
            st = a.state()
            assert st.step_count == 1 and st.task_id == "adapt" and st.trajectory_id
            done = a.step(BunshinAction(answer="done"))
            assert (done.done, done.reward) == (True, 0.5)
            assert a.step(BunshinAction(tool="bash", arguments={"command": "ls"})).observation.error
            # a new episode of the same session: a fresh fork
            a.reset()
            again = a.step(BunshinAction(tool="bash", arguments={"command": "ls"}))
            assert "score" not in again.observation.output and not again.observation.cached
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                b.step({"tool": "bash", "answer": "x"})  # both a call and an answer: refused
            assert b.step({"tool": "bash", "arguments": {"command": "echo ok"}}).observation["output"] == "ok\n"
        # stateless HTTP, as OpenEnv defines it: a bare /step has no episode
        r = httpx.post(f"{url}/step", json={"action": {"tool": "bash", "arguments": {"command": "ls"}}})
        assert r.status_code == 200 and "no episode" in r.json()["observation"]["error"]
        r = httpx.post(f"{url}/step", json={"action": {"answer": "x", "tool": "bash"}})
        assert r.status_code == 422


def test_instance_id_and_a_served_root(served, home):
    with openenv_server(url=served.url, token=served.token) as url:
        with GenericEnvClient(base_url=url).sync() as a, GenericEnvClient(base_url=url).sync() as b:
            for c in (a, b):
                c.reset(instance_id="oe-served")
            ids = [c.step({"tool": "bash", "arguments": {"command": "cat setup.id"}}).observation["output"]
                   for c in (a, b)]
            assert ids[0] == ids[1] and a.state()["instance_id"] == "oe-served"
    with served.client() as c:
        info = c.request("GET", "/v1/groups/oe-served").json()
        assert info["trajectories"] == []  # both sessions' workspaces were removed on disconnect
        c.request("DELETE", "/v1/groups/oe-served")
