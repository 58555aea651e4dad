"""A SkyRL-gym group on bunshin, driven by a scripted policy (as root: `python examples/skyrl/run.py`).

What SkyRL's generator does for one prompt with n_samples_per_prompt=4: four envs from
``skyrl_gym.make("bunshin", env_config=..., extras=row)`` with the row's ``instance_id``,
each stepped in a worker thread. The four copies fork from one root (the setup, a
slow `pip`-like step here, runs once). Pass ``--url http://127.0.0.1:8770`` (and set
BUNSHIN_TOKEN) to share the root across processes through a ``bunshin serve`` host.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import skyrl_gym

import bunshin.adapters.skyrl  # noqa: F401  (registers the "bunshin" env class)
from bunshin.adapters.trajectories import client, close_all

TASK = {
    "id": "skyrl-example",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["sleep 2 && echo 'deps installed' > /work/deps.log"],  # the slow part, run once per instance
    "tools": ["bash", "read_file", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add.",
    "max_turns": 5,
    "reward": "cd /work && python3 -c \"import calc; print(float(calc.add(2, 3) == 5))\"",
}
FIXES = ["a + b", "a * b", "b + a", "a - b"]


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def sample(env: Any, fix: str) -> float:
    """One sample, as SkyRL's agent loop drives it: init, a step per model turn, close."""
    try:
        env.init([{"role": "user", "content": TASK["prompt"]}])
        env.step(call("bash", command="cat deps.log"))
        env.step(call("edit", path="calc.py", old_str="return a - b", new_str=f"return {fix}"))
        return env.step("fixed")["reward"]
    finally:
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a bunshin serve host (default: fork in this process)")
    args = ap.parse_args()
    env_config = {"url": args.url} if args.url else {}
    row = {"task": TASK, "instance_id": "skyrl-calc"}
    t0 = time.perf_counter()
    try:
        envs = [skyrl_gym.make("bunshin", env_config=env_config, extras=dict(row)) for _ in FIXES]
        with ThreadPoolExecutor(len(envs)) as pool:
            rewards = list(pool.map(sample, envs, FIXES))
    finally:
        if args.url:  # the group's root stays on the host for later groups until removed
            client(args.url).request("DELETE", "/v1/groups/skyrl-calc")
        close_all()
    for fix, r in zip(FIXES, rewards, strict=True):
        print(f"return {fix:<6} reward {r}")
    print(f"group of {len(FIXES)} in {time.perf_counter() - t0:.1f} s (setup: 2 s, run once)")
    assert rewards == [1.0, 0.0, 1.0, 0.0]


if __name__ == "__main__":
    main()
