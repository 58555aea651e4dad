"""The rollout benchmark's workloads: tasks plus recorded traces with think times."""

from __future__ import annotations

from ...config import Config
from . import coding, coding_lite, data_analysis
from .common import Workload

NAMES = ("data-analysis", "coding")
EXTRA = ("coding-lite",)


def build(name: str, *, tasks: int, traces: int, seed: int = 0, think_scale: float = 1.0,
          rows: int = 50_000_000, config: Config | None = None) -> Workload:
    """Workload ``name`` with ``tasks`` tasks and ``traces`` traces per task (deterministic in ``seed``)."""
    if name == "data-analysis":
        ts = [data_analysis.task(i, rows=rows, seed=seed) for i in range(tasks)]
        trs = [tr for t in ts for tr in data_analysis.traces(t, traces, seed=seed, think_scale=think_scale)]
        desc = f"Python cells on {rows * 4 // 1_000_000} MB of columns + 200k-row stores table in a persistent interpreter"
    elif name == "coding":
        ts = coding.tasks(config or Config.from_env(), tasks)
        trs = [tr for t in ts for tr in coding.traces(t, traces, seed=seed, think_scale=think_scale)]
        desc = ("the cache benchmark's coding agent: recipekit (shipped with bunshin) — list, read, pip install -e ., "
                "unit tests, diverging edits, re-test")
    elif name == "coding-lite":
        ts = [coding_lite.task(i, seed=seed) for i in range(tasks)]
        trs = [tr for t in ts for tr in coding_lite.traces(t, traces, seed=seed, think_scale=think_scale)]
        desc = "bash/read_file/edit on a small generated project with a virtualenv; unit tests (no download)"
    else:
        raise ValueError(f"unknown workload {name!r}; one of {NAMES + EXTRA}")
    return Workload(name, desc, ts, trs)


__all__ = ["EXTRA", "NAMES", "Workload", "build"]
