"""Gymnasium: the registered env passes gymnasium's own checker on real workspaces."""

from __future__ import annotations

import json

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from bunshin.adapters import gymnasium as bg
from bunshin.errors import InvalidArgument, StateConflict

from .conftest import TASK

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_check_env_passes_on_a_made_env(home):
    env = gymnasium.make(bg.ENV_ID, task=TASK.model_dump(mode="json"), config=home)
    try:
        check_env(env.unwrapped)
        assert isinstance(env.unwrapped, gymnasium.Env) and env.spec.id == "bunshin/Task-v0"
    finally:
        env.close()


def test_episode_forks_from_the_root_and_scores(home):
    env = gymnasium.make(bg.ENV_ID, task=TASK, config=home)
    try:
        obs, info = env.reset(seed=7)
        assert obs["text"] == "write the score" and obs["turn"] == 0
        assert {t["function"]["name"] for t in info["tools"]} == {"bash", "read_file", "write_file"}
        obs, r, term, trunc, info = env.step(call("bash", command="cat setup.log; echo 0.75 > score"))
        assert obs["text"].startswith("setup-ran") and (r, term, trunc) == (0.0, False, False)
        obs, r, term, trunc, info = env.step("I am done")
        assert (r, term, trunc, info["status"]) == (0.75, True, False, "completed")
        assert info["messages"][-1] == {"role": "assistant", "content": "I am done"}
        with pytest.raises(StateConflict):
            env.step("again")
        # a new episode starts from the root again: setup did not re-run, the score is gone
        env.reset()
        obs, *_ = env.step(call("bash", command="cat setup.id; ls"))
        first_pid = obs["text"].split()[0]
        env.reset()
        obs, *_ = env.step(call("bash", command="cat setup.id; ls"))
        assert obs["text"].split()[0] == first_pid and "score" not in obs["text"]
        other = {**TASK.model_dump(mode="json"), "id": "adapt-2", "prompt": "another", "max_turns": 2}
        obs, _ = env.reset(options={"task": other})  # another task: its own root
        assert obs["text"] == "another" and env.observation_space["turn"].n == 3
        obs, *_ = env.step(call("bash", command="cat setup.id"))
        assert obs["text"].split()[0] != first_pid
    finally:
        env.close()


def test_vector_envs_share_one_root(home):
    venv = gymnasium.make_vec(bg.ENV_ID, num_envs=3, vectorization_mode="sync", task=TASK, config=home)
    try:
        venv.reset(seed=1)
        obs, *_ = venv.step([call("bash", command=f"cat setup.id; echo {i} > score") for i in range(3)])
        assert len(set(t.split()[0] for t in obs["text"])) == 1  # one setup, three forks
        _, rewards, term, _, _ = venv.step(["done"] * 3)
        assert list(rewards) == [0.0, 1.0, 2.0] and all(term)
    finally:
        venv.close()


def test_bad_actions_and_truncation(home):
    env = bg.BunshinEnv(TASK, config=home)
    try:
        env.reset()
        obs, r, term, trunc, _ = env.step("<tool_call>{not json</tool_call>")
        assert "not JSON" in obs["text"] and (term, trunc) == (False, False) and obs["turn"] == 0
        obs, *_ = env.step(call("nope"))
        assert "unknown tool" in obs["text"]
        with pytest.raises(InvalidArgument):
            env.step({"name": "bash"})  # type: ignore[arg-type]
        for _ in range(TASK.max_turns - 2):
            assert env.step(call("bash", command="true"))[3] is False
        _, r, term, trunc, info = env.step(call("bash", command="echo 0.5 > score"))
        assert (r, term, trunc, info["status"]) == (0.5, False, True, "max_turns")
    finally:
        env.close()
    with pytest.raises(InvalidArgument, match="render_mode"):
        bg.BunshinEnv(TASK, config=home, render_mode="human")
