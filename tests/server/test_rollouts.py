"""``POST /v1/rollouts`` over real HTTP: a group run on the server against a policy endpoint."""

from __future__ import annotations

import httpx
import pytest

from tests.rollout.fake_openai import FakeChatServer

pytestmark = [pytest.mark.integration, pytest.mark.criu]

TASK = {
    "id": "tiny", "memory": "512M", "workdir": "/work", "prompt": "compute", "max_turns": 4,
    "files": {"/work/hello.txt": "hello\n"}, "setup": ["echo setup-ran > /work/setup.log"],
    "reward": "cat /work/score", "call_timeout": 20, "trajectory_timeout": 60,
}
SCRIPT = [[{"name": "bash", "arguments": {"command": "cat hello.txt setup.log"}}],
          [{"name": "bash", "arguments": {"command": "echo 42 > score"}}]]


def _post(served, body):
    return httpx.post(f"{served.url}/v1/rollouts", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {served.token}"})


def test_a_group_runs_on_the_server_and_answers_its_rows(served):
    with FakeChatServer(SCRIPT) as chat:
        r = _post(served, {"task": TASK, "n": 3, "policy": {"base_url": chat.base_url, "model": "fake"}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["rewards"] == [42.0, 42.0, 42.0] and out["mode"] == "bunshin"
    assert len(out["rows"]) == 3
    first = out["rows"][0]["steps"][0]
    assert first["tool_call"]["name"] == "bash" and first["observation"]["output"] == "hello\nsetup-ran\n"
    assert len(chat.requests) >= 9  # 3 trajectories x (2 tool turns + the final answer)


def test_a_remote_task_may_not_name_a_host_folder(served):
    r = _post(served, {"task": {**TASK, "image": "/etc"}, "n": 1,
                       "policy": {"base_url": "http://127.0.0.1:9", "model": "m"}})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument" and "image" in r.json()["message"]
    r = _post(served, {"task": TASK, "n": 0, "policy": {"base_url": "http://127.0.0.1:9", "model": "m"}})
    assert r.status_code == 422


def test_the_client_runs_a_group_on_the_host(served):
    with FakeChatServer(SCRIPT) as chat, served.client() as c:
        out = c.rollouts(TASK, 2, base_url=chat.base_url, model="fake")
        left = c.list()
    assert out.rewards == [42.0, 42.0] and len(out.rows) == 2
    assert left == []  # the group's root and trajectories were freed by the server
