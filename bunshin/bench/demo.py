"""The README's main job: the rollout comparison at quick size on the host image.

The same recorded traces (groups of 8, two tasks of each workload: a data-analysis
agent holding a few hundred MB in a Python session, a coding agent on a project
with a virtualenv) run in every mode one after another — ``baseline`` (a fresh
workspace per trajectory, setup re-run), ``copy`` (plain CRIU restore of the task
root), ``bunshin`` (live fork + tool prefix cache + speculation) — and the table of
memory, memory-time, makespan, tool latency and rewards is printed. A few minutes.

Its tasks ship with bunshin (``DEMO_WORKLOADS``: the data is generated, the coding
project is written by the setup), so it downloads nothing and gives the same
workload on every machine.
"""

from __future__ import annotations

from .. import console as output
from ..config import Config
from . import rollout as bench_rollout

#: The demo's workloads: built from what bunshin ships, nothing fetched at run time.
DEMO_WORKLOADS = ("data-analysis", "coding-lite")


def plan() -> bench_rollout.Plan:
    """``bench rollout --quick`` on the workloads that ship with bunshin."""
    return bench_rollout.Plan.make(quick=True, workloads=DEMO_WORKLOADS)


def run(cfg: Config, *, as_json: bool = False, report: str | None = None) -> int:
    output.err.print("bunshin demo: the same rollouts in baseline, copy and bunshin mode, side by side "
                     "(bench rollout --quick; about 3-4 minutes)")
    result = bench_rollout.run(cfg, plan())
    if report:
        from . import rollout_report

        rollout_report.write(result, report)
        output.err.print(f"report written to {report}/report.md")
    if as_json:
        output.print_json(result)
    else:
        bench_rollout.print_report(result)
    failed = sum(m["failed"] for m in result["modes"].values())
    return 0 if result["same_rewards"] and not failed else 1
