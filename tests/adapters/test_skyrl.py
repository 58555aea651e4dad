"""SkyRL-gym: skyrl_gym.make("bunshin") on real workspaces; the copies of an instance fork one root,
in one process (the adapters' engine) and across processes (the server's group key)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import skyrl_gym

import bunshin.adapters.skyrl  # noqa: F401  (registers the "bunshin" env class)
from bunshin.errors import InvalidArgument, StateConflict

from .conftest import TASK

pytestmark = [pytest.mark.integration, pytest.mark.criu]
TASK_JSON = TASK.model_dump(mode="json")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def make(home, **extras):
    return skyrl_gym.make("bunshin", env_config={"config": home}, extras={"task": TASK_JSON, **extras})


def test_copies_of_an_instance_fork_one_root(home):
    envs = [make(home, instance_id="inst-1") for _ in range(3)] + [make(home, instance_id="inst-2")]
    try:
        pids = []
        for i, env in enumerate(envs):
            prompt, meta = env.init([{"role": "user", "content": "go"}])
            assert prompt == [{"role": "user", "content": "go"}] and meta["instance_id"].startswith("inst-")
            out = env.step(call("bash", command=f"cat setup.id; echo {i} > score"))
            assert (out["done"], out["reward"]) == (False, 0.0)
            assert out["observations"][0]["role"] == "user"
            pids.append(out["observations"][0]["content"].split()[1])
        assert len(set(pids[:3])) == 1 and pids[3] != pids[0]  # one setup per instance
        for i, env in enumerate(envs):
            out = env.step("the answer")
            assert (out["done"], out["reward"], out["observations"]) == (True, float(i), [])
        # the second copy's identical call was served by the instance's prefix cache
        assert envs[0].get_metrics()["tool_calls"] == 1
    finally:
        for env in envs:
            env.close()


def test_max_turns_bad_calls_and_errors(home):
    env = make(home, instance_id="inst-3", max_turns=2)
    try:
        env.init([])
        out = env.step("<tool_call>{oops</tool_call>")
        assert "not JSON" in out["observations"][0]["content"] and not out["done"]
        out = env.step(call("bash", command="echo 0.5 > score"))
        assert (out["done"], out["reward"]) == (True, 0.5)  # the generator's max_turns reached
        with pytest.raises(StateConflict):
            env.init([])
    finally:
        env.close()
    with pytest.raises(InvalidArgument, match="names no bunshin task"):
        skyrl_gym.make("bunshin", env_config={}, extras={"instance_id": "x"})
    with pytest.raises(StateConflict, match="before init"):
        make(home).step("x")


CHILD = r"""
import json, sys, skyrl_gym
import bunshin.adapters.skyrl
from bunshin.adapters.trajectories import close_all
url, token, task = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
env = skyrl_gym.make("bunshin", env_config={"url": url, "token": token},
                     extras={"task": task, "instance_id": "served-1"})
env.init([])
out = env.step('<tool_call>{"name": "bash", "arguments": {"command": "cat setup.id; echo 1 > score"}}</tool_call>')
pid = out["observations"][0]["content"].split()[1]
done = env.step("done")
env.close()
close_all()
print(json.dumps({"pid": pid, "reward": done["reward"]}))
"""


def test_copies_in_several_processes_share_the_served_root(served):
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, served.url, served.token, json.dumps(TASK_JSON)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert len({o["pid"] for o in outs}) == 1 and [o["reward"] for o in outs] == [1.0] * 3
    with served.client() as c:
        info = c.request("GET", "/v1/groups/served-1").json()
        assert info["task"] == "served-1" and info["trajectories"] == []  # one root; every copy closed
        c.request("DELETE", "/v1/groups/served-1")
