"""The Gymnasium-style wrapper on fake workspaces."""

from __future__ import annotations

import asyncio

import pytest

from bunshin.errors import StateConflict
from bunshin.rollout import RolloutEngine, RolloutEnv, ToolCall
from bunshin.rollout.task import TaskSpec

from .fakes import FakeEnv, FakeTools

TASK = TaskSpec(id="t1", prompt="go", reward="score", max_turns=3)


def make_env(envs: list):
    tools = FakeTools()

    def factory(task):
        envs.append(FakeEnv(task, tools))
        return envs[-1]
    return RolloutEnv(engine=RolloutEngine(tools=tools, env_factory=factory))


def test_reset_step_terminate():
    envs: list = []
    with make_env(envs) as env:
        obs, info = env.reset(TASK)
        assert obs["messages"] == [{"role": "user", "content": "go"}] and obs["turn"] == 0
        assert {t["function"]["name"] for t in obs["tools"]} >= {"echo", "write"}
        obs, r, term, trunc, info = env.step({"name": "echo", "arguments": {"text": "x"}})
        assert (r, term, trunc) == (0.0, False, False) and obs["messages"][-1]["content"] == "x"
        assert info["steps"][0].observation.output == "x"
        env.step([ToolCall("write", {"path": "/score", "content": "0.25"})])
        obs, r, term, trunc, info = env.step("finished")
        assert (r, term, trunc) == (0.25, True, False) and info["status"] == "completed"
        assert obs["messages"][-1] == {"role": "assistant", "content": "finished"}
        assert env.last_result.reward == 0.25
        with pytest.raises(StateConflict):
            env.step("again")
    assert envs[0].closed == envs[0].opened  # the shared engine (and its task root) outlives the env


def test_truncation_error_and_reset_reuses_the_root():
    envs: list = []
    with make_env(envs) as env:
        env.reset(TASK)
        for _ in range(2):
            assert env.step({"name": "echo", "arguments": {}})[3] is False
        _, r, term, trunc, info = env.step({"name": "echo", "arguments": {}})
        assert (term, trunc, info["status"]) == (False, True, "max_turns")
        env.reset(TASK, index=1)
        _, r, term, trunc, info = env.step({"name": "crash", "arguments": {}})
        assert (r, term, info["status"]) == (0.0, True, "error") and "vanished" in info["error"]
        env.reset(TASK)
        env.reset(TASK)  # an unfinished episode is closed by the next reset
    assert len(envs) == 1 and envs[0].prepared == 1
    assert sorted(envs[0].closed) == sorted(envs[0].opened) and len(envs[0].opened) == 4


def test_async_api():
    envs: list = []

    async def go():
        env = make_env(envs)
        await env.areset(TASK)
        await env.astep({"name": "write", "arguments": {"path": "/score", "content": "1"}})
        out = await env.astep(None)
        await env.aclose()
        return out

    _, r, term, _, _ = asyncio.run(go())
    assert r == 1.0 and term
