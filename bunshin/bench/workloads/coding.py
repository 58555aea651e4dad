"""Workload (b): the coding agent of the cache benchmark (``bunshin bench cache``), as rollout tasks.

The project is ``recipekit`` (:mod:`bunshin.bench.task_project`, shipped with bunshin:
nothing is downloaded), written into ``/task`` before the setup. Trajectories make the
cache benchmark's calls: list, read the README, ``pip install -e .``, run the tests,
look around (the shared prefix), then read, edit and re-test with diverging edits,
some with a follow-up edit, and a final import check. The reward is the fraction of
the project's unit tests that pass in the final workspace. Each task draws its
group's edits with its own seed.
"""

from __future__ import annotations

import random

from ...config import Config
from ...rollout.policies import Trace
from ...rollout.task import TaskSpec, parse_task
from ...tools import Step, ToolCall
from .. import cache as cache_bench
from .. import task_project
from .common import think

SCORE = r'''
import re, sys
out = sys.stdin.read()
ran = re.search(r"Ran (\d+) tests?", out)
if not ran or int(ran.group(1)) == 0:
    print(0.0)
    sys.exit()
n = int(ran.group(1))
bad = sum(int(x) for x in re.findall(r"(?:failures|errors)=(\d+)", out))
print(round((n - bad) / n, 4))
'''


def task(i: int) -> TaskSpec:
    root = cache_bench.TASK
    project = {f"{root}/{path}": text for path, text in task_project.FILES.items()}
    return parse_task({
        "id": f"code-{i}",
        "memory": "2G",
        "files": {**project, "/opt/grader/score.py": SCORE},
        "setup": [f"test -f {root}/setup.py"],
        "tools": ["bash", "read_file", "edit"],
        "workdir": root,
        "prompt": f"Improve the recipes in {cache_bench.RECIPES} without breaking the tests (issue #{200 + i}).",
        "max_turns": 16,
        "reward": f"cd {root} && python3 -m unittest -q 2>&1 | python3 /opt/grader/score.py",
        "call_timeout": 300,
        "trajectory_timeout": 1200,
        "metadata": {"workload": "coding", "project": f"{cache_bench.PACKAGE}=={cache_bench.VERSION}"},
    })


def tasks(cfg: Config, n: int) -> list[TaskSpec]:
    """``n`` tasks of the workload (``cfg``: unused, nothing is fetched)."""
    return [task(i) for i in range(n)]


def traces(t: TaskSpec, n: int, *, seed: int, think_scale: float) -> list[Trace]:
    """The cache benchmark's calls for a group of ``n`` (edits drawn per task), with think times."""
    index = int(t.id.rsplit("-", 1)[1])
    group = cache_bench.traces(n, 1, seed * 100 + index)[0]
    out = []
    for j, calls in enumerate(group):
        rng = random.Random(f"{seed}:{t.id}:{j}")
        steps = tuple(Step(i + 1, think(rng, think_scale), ToolCall(name, dict(args)))
                      for i, (name, args) in enumerate(calls))
        out.append(Trace(f"{t.id}-trace-{j}", steps, task=t.id, final_content="done",
                         final_think_s=think(rng, think_scale) / 2))
    return out
