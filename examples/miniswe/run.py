"""A mini-swe-agent group on bunshin, driven by a scripted model (as root: `python examples/miniswe/run.py`).

What a trainer using mini-swe-agent does for one task with 4 samples: four environments
built by mini-swe-agent's own ``get_environment`` from the dotted class path, four
``DefaultAgent`` loops in threads, each with its own scripted answers (mini-swe-agent's
``DeterministicModel``). The four workspaces fork from one root: the setup (a venv and a
slow step here) runs once. ``--url http://127.0.0.1:8770`` (with BUNSHIN_TOKEN set) puts
the root on a ``bunshin serve`` host, shared by every process that uses the same group key.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from bunshin.adapters.miniswe import release_group  # noqa: E402

ENV = {
    "environment_class": "bunshin.adapters.miniswe.BunshinEnvironment",
    "cwd": "/work",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["sleep 2 && echo 'deps installed' > /work/deps.log"],  # the slow part, run once per group
    "group": "miniswe-example",
}
FIXES = ["a + b", "a * b", "b + a", "a - b"]
REWARD = "python3 -c 'import calc; print(float(calc.add(2, 3) == 5))'"


def script(fix: str) -> list[dict[str, Any]]:
    return [make_output(text, [{"command": cmd}]) for text, cmd in [
        ("Read the code.", "cat calc.py deps.log"),
        ("Fix it.", f"sed -i 's/return a - b/return {fix}/' calc.py"),
        ("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat calc.py"),
    ]]


def run_one(config: dict[str, Any], fix: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    env: Any = get_environment(config)  # mini-swe-agent's own factory, from the dotted path
    ready = time.perf_counter() - t0
    try:
        agent = DefaultAgent(DeterministicModel(outputs=script(fix)), env, system_template="You fix bugs.",
                             instance_template="{{task}}", step_limit=10, cost_limit=0)
        result = agent.run("Make calc.add add.")
        reward = env.execute({"command": REWARD})["output"].strip()
        return {"fix": fix, "exit": result["exit_status"], "reward": reward, "workspace": env.ws.id,
                "env_ready_s": round(ready, 2)}
    finally:
        env.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a bunshin serve host (token in BUNSHIN_TOKEN)")
    ap.add_argument("-n", type=int, default=4, help="runs of the task (default 4)")
    args = ap.parse_args()
    config = {**ENV, **({"url": args.url} if args.url else {})}
    try:
        with ThreadPoolExecutor(args.n) as pool:
            for row in pool.map(lambda i: run_one(config, FIXES[i % len(FIXES)]), range(args.n)):
                print(row)
    finally:
        release_group(config["group"], url=args.url)


if __name__ == "__main__":
    main()
