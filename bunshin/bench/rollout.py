"""``bunshin bench rollout``: the same rollouts in every mode, one after another, side by side.

Two workloads (a data-analysis agent holding a few hundred MB in a persistent Python
interpreter; a coding agent on a small project with a virtualenv), several tasks
each, groups of 8 and 32 trajectories (``--quick``: 8), driven by recorded traces
with think times. Each (mode, workload) phase runs alone while memory is sampled;
between phases everything is removed and memory settles. Reported per mode:
system-wide peak memory and memory-time (GB·s) above the idle level, makespan, tool
and trajectory latency, and whether every mode gave the same rewards for the same traces.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import BunshinError
from ..rollout import ModeOptions, RolloutEngine, TraceReplayPolicy
from ..rollout.progress import GroupProgress
from ..rollout.records import TrajectoryResult
from ..workspace import Workspace
from . import workloads as wl
from .sampler import MemorySampler, Series, idle_used
from .stats import summary, system_used_bytes

#: label -> (engine mode, options); the ``bunshin:*`` labels are ablations
MODES: dict[str, tuple[str, ModeOptions]] = {
    "baseline": ("baseline", ModeOptions()),
    "copy": ("copy", ModeOptions()),
    "bunshin": ("bunshin", ModeOptions()),
    "bunshin:no-spec": ("bunshin", ModeOptions(speculation=False)),
    "bunshin:no-cache": ("bunshin", ModeOptions(cache=False)),
    "bunshin:no-fork": ("bunshin", ModeOptions(fork=False)),
}
GOALS = {"peak": 0.43, "gb_s": 0.51, "latency": 0.23}  # BunshinRL against isolated environments


@dataclass(frozen=True)
class Plan:
    """What one benchmark run does."""

    modes: tuple[str, ...]
    workloads: tuple[str, ...]
    group_sizes: tuple[int, ...]
    tasks: int
    think_scale: float
    rows: int
    concurrency: int = 32
    settle_s: float = 2.0
    seed: int = 0

    @classmethod
    def make(cls, *, quick: bool, modes: tuple[str, ...] | None = None,
             workloads: tuple[str, ...] | None = None, think_scale: float | None = None,
             group_sizes: tuple[int, ...] | None = None, tasks: int | None = None) -> Plan:
        if modes is None:
            modes = ("baseline", "copy", "bunshin")
            if not quick:
                modes += ("bunshin:no-spec", "bunshin:no-cache")
        for m in modes:
            if m not in MODES:
                raise ValueError(f"unknown mode {m!r}; one of {', '.join(MODES)}")
        for w in workloads or ():
            if w not in wl.NAMES + wl.EXTRA:
                raise ValueError(f"unknown workload {w!r}; one of {', '.join(wl.NAMES + wl.EXTRA)}")
        return cls(modes=modes, workloads=workloads or wl.NAMES,
                   group_sizes=group_sizes or ((8,) if quick else (8, 32)), tasks=tasks or (2 if quick else 3),
                   think_scale=think_scale if think_scale is not None else (0.5 if quick else 1.0),
                   rows=50_000_000)


@dataclass
class Phase:
    """One mode on one workload."""

    mode: str
    workload: str
    makespan_s: float
    idle_bytes: int
    series: Series
    trajectories: list[TrajectoryResult]
    groups: list[dict[str, Any]] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)
    options: dict[str, bool] = field(default_factory=dict)

    def rewards(self) -> dict[str, float | None]:
        return {f"{self.workload}/{t.group_id.rsplit('-g-', 1)[0]}/{g}/{t.index}": t.reward
                for g, ts in self._by_size().items() for t in ts}

    def _by_size(self) -> dict[int, list[TrajectoryResult]]:
        out: dict[int, list[TrajectoryResult]] = {}
        for grp in self.groups:
            out.setdefault(grp["n"], []).extend(t for t in self.trajectories if t.group_id == grp["group_id"])
        return out

    def to_dict(self) -> dict[str, Any]:
        ts = self.trajectories
        steps = [s for t in ts for s in t.steps]
        return {
            "mode": self.mode, "workload": self.workload, "options": self.options,
            "makespan_s": round(self.makespan_s, 3),
            "peak_bytes": self.series.peak(self.idle_bytes), "gb_s": round(self.series.gb_s(self.idle_bytes), 3),
            "idle_bytes": self.idle_bytes,
            "ws_peak_bytes": self.series.ws_peak(), "ws_gb_s": round(self.series.ws_gb_s(), 3),
            "tool_latency_s": summary([s.latency_s for s in steps]),
            "trajectory_s": summary([t.timings.total_s for t in ts]),
            "breakdown_s": {k: _mean([getattr(t.timings, k) for t in ts])
                            for k in ("queued_s", "env_s", "think_s", "tools_s", "reward_s", "total_s")},
            "trajectories": len(ts), "failed": sum(not t.ok for t in ts),
            "errors": sorted({t.error for t in ts if t.error})[:5],
            "cached_calls": sum(s.observation is not None and s.observation.cached for s in steps),
            "speculated_calls": sum(s.observation is not None and s.observation.speculated for s in steps),
            "calls": len(steps), "groups": self.groups, "cache": self.cache,
            "series": self.series.downsampled(),
        }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


async def _phase_rollouts(cfg: Config, label: str, work: wl.Workload, plan: Plan,
                          progress: GroupProgress) -> tuple[list, dict, dict]:
    mode, options = MODES[label]
    policy = TraceReplayPolicy(work.traces)
    groups = []
    async with RolloutEngine(mode, options=options, concurrency=plan.concurrency, config=cfg,
                             on_event=progress) as engine:
        for n in plan.group_sizes:
            groups += await engine.run(work.tasks, policy, n)
        cache = output.to_jsonable(engine.cache_stats())
        opts = engine.options_in_effect()
    return groups, cache, opts


def run_phase(cfg: Config, label: str, work: wl.Workload, plan: Plan) -> Phase:
    idle = idle_used(1.0)
    with GroupProgress(f"{label} {work.name}") as progress, MemorySampler(cfg) as sampler:
        t0 = time.perf_counter()
        groups, cache, opts = asyncio.run(_phase_rollouts(cfg, label, work, plan, progress))
        makespan = time.perf_counter() - t0
    trajs = [t for g in groups for t in g.trajectories]
    gsum = [{"task": g.task_id, "group_id": g.group_id, "n": len(g.trajectories),
             "makespan_s": round(g.makespan_s, 3), "prepare_s": round(g.prepare_s, 3), "failed": g.failed}
            for g in groups]
    return Phase(label, work.name, makespan, idle, sampler.series, trajs, gsum, cache, opts)


def settle(seconds: float, *, window_s: float = 1.5, tolerance: int = 64 << 20, limit_s: float = 10.0) -> None:
    """Wait for memory to come back down after a phase: at least ``seconds``, then until
    system-wide used memory moved less than ``tolerance`` over ``window_s`` (or ``limit_s``)."""
    time.sleep(seconds)
    samples: list[tuple[float, int]] = []
    end = time.perf_counter() + limit_s
    while time.perf_counter() < end:
        now = time.perf_counter()
        samples = [(t, u) for t, u in samples if now - t <= window_s] + [(now, system_used_bytes())]
        if now - samples[0][0] >= window_s * 0.95:
            us = [u for _, u in samples]
            if max(us) - min(us) < tolerance:
                return
        time.sleep(0.2)


def warm_up(cfg: Config) -> None:
    """One workspace used and removed, so the first phase does not pay cold caches alone."""
    from ..tools import ToolSet

    ws = Workspace.create("host", memory="1G", config=cfg)
    try:
        ts = ToolSet.default()
        ts.run_sync(ws, "python", {"code": "1"})
        ts.run_sync(ws, "bash", {"command": "python3 -m venv /tmp/v >/dev/null && echo ok"})
    finally:
        ws.remove()


def _build(cfg: Config, name: str, plan: Plan) -> wl.Workload:
    def build(workload: str) -> wl.Workload:
        return wl.build(workload, tasks=plan.tasks, traces=max(plan.group_sizes), seed=plan.seed,
                        think_scale=plan.think_scale, rows=plan.rows, config=cfg)

    try:
        return build(name)
    except BunshinError as e:
        if name != "coding":
            raise
        output.err.print(f"[yellow]coding workload unavailable ({e.message}); using coding-lite instead[/]")
        return build("coding-lite")


def run(cfg: Config, plan: Plan) -> dict[str, Any]:
    """Every (mode, workload) phase in turn; the summary the CLI prints and ``--json`` emits."""
    loads = {name: _build(cfg, name, plan) for name in plan.workloads}
    warm_up(cfg)
    settle(plan.settle_s)
    phases: list[Phase] = []
    t0 = time.perf_counter()
    for label in plan.modes:
        for name in plan.workloads:
            output.err.print(f"[dim]phase: {label} / {name}[/]")
            phases.append(run_phase(cfg, label, loads[name], plan))
            settle(plan.settle_s)
    return summarize(plan, phases, loads, time.perf_counter() - t0)


def reduction(base: float | None, new: float | None) -> float | None:
    """``1 - new/base`` (0.6 = 60 % less), or None."""
    if not base or new is None:
        return None
    return round(1 - new / base, 4)


def summarize(plan: Plan, phases: list[Phase], loads: dict[str, wl.Workload], wall_s: float) -> dict[str, Any]:
    per = [p.to_dict() for p in phases]
    modes: dict[str, Any] = {}
    for label in plan.modes:
        mine = [p for p in phases if p.mode == label]
        steps = [s.latency_s for p in mine for t in p.trajectories for s in t.steps]
        totals = [t.timings.total_s for p in mine for t in p.trajectories]
        modes[label] = {
            "peak_bytes": max(p.series.peak(p.idle_bytes) for p in mine),
            "gb_s": round(sum(p.series.gb_s(p.idle_bytes) for p in mine), 3),
            "makespan_s": round(sum(p.makespan_s for p in mine), 3),
            "ws_peak_bytes": max(p.series.ws_peak() for p in mine),
            "ws_gb_s": round(sum(p.series.ws_gb_s() for p in mine), 3),
            "tool_latency_s": summary(steps),
            "trajectory_s": summary(totals),
            "trajectories": sum(len(p.trajectories) for p in mine),
            "failed": sum(sum(not t.ok for t in p.trajectories) for p in mine),
            "options": mine[0].options if mine else {},
        }
    rewards: dict[str, dict[str, float | None]] = {p.mode: {} for p in phases}
    for p in phases:
        rewards[p.mode].update(p.rewards())
    ref = rewards.get(plan.modes[0], {})
    mismatches = sorted({k for m, r in rewards.items() for k in set(ref) | set(r) if r.get(k) != ref.get(k)})
    nones = sorted(k for r in rewards.values() for k, v in r.items() if v is None)
    same = not mismatches and not nones and bool(ref)
    vs: dict[str, Any] = {}
    base = modes.get("baseline")
    if base:
        for label, m in modes.items():
            if label == "baseline":
                continue
            vs[label] = {"peak": reduction(base["peak_bytes"], m["peak_bytes"]),
                         "gb_s": reduction(base["gb_s"], m["gb_s"]),
                         "makespan": reduction(base["makespan_s"], m["makespan_s"]),
                         "trajectory_mean": reduction(base["trajectory_s"]["mean"], m["trajectory_s"]["mean"]),
                         "ws_peak": reduction(base["ws_peak_bytes"], m["ws_peak_bytes"]),
                         "ws_gb_s": reduction(base["ws_gb_s"], m["ws_gb_s"])}
    b = vs.get("bunshin", {})
    goals = {"peak": {"goal": GOALS["peak"], "got": b.get("peak")},
             "gb_s": {"goal": GOALS["gb_s"], "got": b.get("gb_s")},
             "latency": {"goal": GOALS["latency"], "got": b.get("makespan")}}
    for g in goals.values():
        g["met"] = g["got"] is not None and g["got"] >= g["goal"]
    return {
        "plan": {"modes": list(plan.modes), "workloads": {loads[n].name: loads[n].description for n in plan.workloads},
                 "group_sizes": list(plan.group_sizes), "tasks_per_workload": plan.tasks,
                 "think_scale": plan.think_scale, "concurrency": plan.concurrency,
                 "cache_available": True},  # the cache is part of bunshin
        "modes": modes, "vs_baseline": vs, "goals": goals,
        "same_rewards": same, "rewards_compared": len(ref), "reward_mismatches": mismatches[:20],
        "missing_rewards": nones[:20],
        "mean_reward": {m: (round(sum(v for v in r.values() if v is not None) / max(1, len(r)), 4)) for m, r in rewards.items()},
        "phases": per, "wall_s": round(wall_s, 1),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{-x * 100:+.0f} %"


def print_report(r: dict[str, Any]) -> None:
    hb = output.human_bytes
    rows: list[tuple[Any, ...]] = []
    for p in r["phases"]:
        rows.append((p["mode"], p["workload"], hb(p["peak_bytes"]), f"{p['gb_s']:.1f}", hb(p["ws_peak_bytes"]),
                     f"{p['makespan_s']:.1f}",
                     f"{p['tool_latency_s']['p50'] * 1000:.0f} / {p['tool_latency_s']['p95'] * 1000:.0f}",
                     f"{p['trajectory_s']['mean']:.1f}", f"{p['breakdown_s']['env_s']:.2f}",
                     f"{p['cached_calls']}/{p['calls']}", f"{p['failed']}/{p['trajectories']}"))
    output.print_table(
        f"bunshin bench rollout: groups of {r['plan']['group_sizes']}, {r['plan']['tasks_per_workload']} tasks per "
        f"workload, think x{r['plan']['think_scale']}, {r['wall_s']:.0f} s in all",
        ["MODE", "WORKLOAD", "PEAK MEM", "GB·S", "OWN PEAK", "MAKESPAN S", "TOOL P50/P95 MS", "TRAJ MEAN S",
         "ENV S", "CACHED", "FAILED"], rows)
    output.out.print("PEAK MEM, GB·S: system-wide used memory above idle (tmpfs memory files included); OWN PEAK: "
                     "this bunshin home's workspace cgroups + snapshot files only (immune to other processes)")
    rows = []
    for label, m in r["modes"].items():
        v = r["vs_baseline"].get(label, {})
        rows.append((label, hb(m["peak_bytes"]), _pct(v.get("peak")), f"{m['gb_s']:.1f}", _pct(v.get("gb_s")),
                     f"{m['makespan_s']:.1f}", _pct(v.get("makespan")),
                     f"{m['tool_latency_s']['p50'] * 1000:.0f} / {m['tool_latency_s']['p95'] * 1000:.0f}",
                     hb(m["ws_peak_bytes"]), f"{m['failed']}/{m['trajectories']}"))
    output.print_table("per mode (both workloads; % against baseline)",
                       ["MODE", "PEAK MEM", "Δ", "GB·S", "Δ", "MAKESPAN S", "Δ", "TOOL P50/P95 MS",
                        "OWN PEAK", "FAILED"], rows)
    g = r["goals"]
    output.out.print(
        "goals (bunshin vs baseline; BunshinRL: −43 % peak, −51 % total memory, −23 % latency): "
        + ", ".join(f"{k} {_pct(v['got'])} {'met' if v['met'] else 'NOT met'}" for k, v in g.items())
        + f"; same rewards in every mode: {'yes' if r['same_rewards'] else 'NO'} ({r['rewards_compared']} trajectories)")
