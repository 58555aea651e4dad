"""What the framework benchmarks (``bench adapters --framework miniswe|skyrl``) share:
their arguments checked, their one task and traces, the comparison with the baseline and
the report's cells."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..rollout.policies import Trace
from ..rollout.task import TaskSpec
from . import workloads as wl
from .rollout import reduction, settle, warm_up


def group_task(cfg: Config, *, modes: Sequence[str], known: Sequence[str], group: int, workload: str,
               think_scale: float, settle_s: float) -> tuple[wl.Workload, TaskSpec, list[Trace]]:
    """Check a framework benchmark's arguments, then build its one task of ``workload`` and
    ``group`` traces, warm the machine up and let it settle."""
    for m in modes:
        if m not in known:
            raise InvalidArgument(f"unknown mode {m!r}", hint=f"one of {', '.join(known)}")
    if group < 1:
        raise InvalidArgument(f"--group must be >= 1, got {group}")
    try:
        work = wl.build(workload, tasks=1, traces=group, think_scale=think_scale, config=cfg)
    except ValueError as e:
        raise InvalidArgument(str(e), hint="--workload coding or coding-lite") from None
    except Exception as e:
        if workload != "coding":
            raise
        output.err.print(f"[yellow]coding workload unavailable ({e}); using coding-lite instead[/]")
        work = wl.build("coding-lite", tasks=1, traces=group, think_scale=think_scale, config=cfg)
    warm_up(cfg)
    settle(settle_s)
    return work, work.tasks[0], work.traces[:group]


def group_result(framework: str, workload: str, task: str, group: int, think_scale: float,
                 rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The report of a framework benchmark: its modes' rows, each against the baseline's."""
    base = next((r for r in rows if r["label"] == "baseline"), None)
    for r in rows:
        if base is not None and r is not base:
            r["vs_baseline"] = {k: reduction(base[k], r[k]) for k in ("peak_bytes", "gb_s", "makespan_s",
                                                                        "ws_peak_bytes")}
    return {"framework": framework, "workload": workload, "task": task, "group": group,
            "think_scale": think_scale, "modes": rows,
            "same_rewards": len({tuple(r["rewards"]) for r in rows}) == 1}


def report_cells(m: dict[str, Any]) -> tuple[str, ...]:
    """A mode's memory and time cells, each with its change against the baseline."""
    hb, v = output.human_bytes, m.get("vs_baseline", {})

    def pct(k: str) -> str:
        x = v.get(k)
        return "" if x is None else f" ({-x * 100:+.0f} %)"

    return (m["label"], hb(m["peak_bytes"]) + pct("peak_bytes"), f"{m['gb_s']:.1f}" + pct("gb_s"),
            hb(m["ws_peak_bytes"]) + pct("ws_peak_bytes"), f"{m['makespan_s']:.1f}" + pct("makespan_s"),
            f"{m['env_s']['p50']:.2f}")
