"""rLLM's environment and sandbox interfaces on bunshin, with a scripted policy
(as root: `python examples/rllm/run.py`).

Four envs from one task row (``BunshinEnv.from_dict``, as an rLLM workflow builds one per
rollout): each ``reset`` forks the instance's root (its slow setup ran once), the
scripted agent uploads a test file through the sandbox protocol, edits, and stops;
the task's reward scores each. Pass ``--url`` (and set BUNSHIN_TOKEN) for a served root.
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bunshin.adapters.rllm import BunshinEnv
from bunshin.adapters.trajectories import client, close_all

TASK = {
    "id": "rllm-example",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["sleep 2 && echo ready > /work/deps.log"],  # the slow part, run once per instance
    "tools": ["bash", "read_file", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add.",
    "max_turns": 5,
    "reward": "cd /work && PYTHONPATH=/work python3 -B tests/check.py",
}
FIXES = ["a + b", "a * b", "b + a", "a - b"]


def rollout(env: BunshinEnv, fix: str, tests: Path) -> float:
    try:
        env.reset()
        env.sandbox().upload_dir(str(tests), "/work/tests")  # rLLM's sandbox protocol on the same workspace
        env.step({"name": "edit", "arguments": {"path": "calc.py", "old_str": "return a - b",
                                                "new_str": f"return {fix}"}})
        _, reward, done, info = env.step("fixed")
        assert done and not info["reward_error"], info
        return reward
    finally:
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a bunshin serve host (default: fork in this process)")
    url = ap.parse_args().url
    row = {"task": TASK, "instance_id": "rllm-calc", **({"url": url} if url else {})}
    with tempfile.TemporaryDirectory() as tmp:
        tests = Path(tmp, "tests")
        tests.mkdir()
        (tests / "check.py").write_text("import calc\nprint(float(calc.add(2, 3) == 5))\n")
        envs = [BunshinEnv.from_dict(dict(row)) for _ in FIXES]
        try:
            with ThreadPoolExecutor(len(envs)) as pool:
                rewards = list(pool.map(rollout, envs, FIXES, [tests] * len(envs)))
        finally:
            if url:  # the group's root stays on the host for later groups until removed
                client(url).request("DELETE", "/v1/groups/rllm-calc")
            close_all()
    for fix, r in zip(FIXES, rewards, strict=True):
        print(f"return {fix:<6} reward {r}")
    assert rewards == [1.0, 0.0, 1.0, 0.0]


if __name__ == "__main__":
    main()
