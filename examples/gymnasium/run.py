"""A bunshin task as a Gymnasium env, driven by a scripted policy (as root: `python examples/gymnasium/run.py`).

Four envs of one task in one process (``gymnasium.make_vec``): the task's setup runs
once, each env's episode is a fork of that root. Each scripted "model" fixes the bug
its own way; the reward is the fraction of the tests that pass.
"""

from __future__ import annotations

import json

import gymnasium

import bunshin.adapters.gymnasium as bg
from bunshin.adapters.trajectories import close_all

TASK = {
    "id": "gym-example",
    "memory": "512M",
    "files": {
        "/work/calc.py": "def add(a, b):\n    return a - b\n",
        "/work/test_calc.py": "from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n\n"
                              "def test_zero():\n    assert add(0, 0) == 0\n",
    },
    "setup": ["cd /work && python3 -B -c 'import calc'"],  # -B: a stale .pyc would hide a same-size edit
    "tools": ["bash", "read_file", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add so that the tests pass.",
    "max_turns": 6,
    "reward": "cd /work && python3 -c \"import calc; t = [calc.add(2, 3) == 5, calc.add(0, 0) == 0]; print(sum(t) / len(t))\"",
}
FIXES = ["a + b", "a - b", "b + a", "abs(a) + b"]


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def main() -> None:
    envs = gymnasium.make_vec(bg.ENV_ID, num_envs=len(FIXES), vectorization_mode="sync", task=TASK)
    try:
        obs, _ = envs.reset(seed=0)
        print("prompt:", obs["text"][0])
        envs.step([call("read_file", path="calc.py")] * len(FIXES))
        envs.step([call("edit", path="calc.py", old_str="return a - b", new_str=f"return {fix}") for fix in FIXES])
        _, rewards, terminated, _, _ = envs.step(["done"] * len(FIXES))
        for fix, r in zip(FIXES, rewards, strict=True):
            print(f"return {fix:<12} reward {r:.2f}")
        assert list(rewards) == [1.0, 0.5, 1.0, 1.0] and all(terminated)
    finally:
        envs.close()
        close_all()


if __name__ == "__main__":
    main()
