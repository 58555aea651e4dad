"""``bunshin bench cache``: the tool prefix cache and speculation on a real coding task.

The task is a small Python project with its own unittest suite (``recipekit``,
iterator recipes: :mod:`bunshin.bench.task_project`, shipped with bunshin, so nothing
is downloaded and every machine runs the same task) written into a workspace and
snapshotted as the task root. A group of trajectories makes the calls agents make: list, read the
README, install, test, look around (a shared prefix), then read, edit and test
with diverging edits (some trajectories pick the same one), with a think time
before every call. Side by side, on the same traces and think times:

- ``nocache``: a fresh fork of the root per trajectory, every call executed;
- ``cache``: the prefix cache;
- ``speculate``: the prefix cache with speculative execution.

The group runs for several training iterations (new edits each time, the cache
kept). Every trajectory's observations and end state (file tree hash, shell
environment, process list, installed packages) in the cached modes are compared
with ``nocache``: ``correct`` is true only when all of them match.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from dataclasses import dataclass, field
from typing import Any

from rich.progress import Progress

from .. import console as output
from ..cache import CachePolicy, PrefixCache
from ..config import Config
from ..speculate import SpeculationPolicy
from ..tools import Observation, ToolSet
from ..workspace import Snapshot, Workspace
from ..workspace.aio import AsyncSnapshot, AsyncWorkspace
from ..workspace.protocol import WorkspaceAPI
from . import task_project
from .stats import percentile, summary

PACKAGE, VERSION = task_project.PACKAGE, task_project.VERSION
TASK = "/task"
TEST = "python3 -m unittest -q 2>&1 | tail -4 | sed -E 's/ in [0-9.]+s$//'"
INSTALL = "pip install --break-system-packages -e . --no-deps --no-build-isolation -q 2>&1 | tail -3"
RECIPES = "recipekit/recipes.py"
Call = tuple[str, dict[str, Any]]


def bash(cmd: str) -> Call:
    return "bash", {"command": cmd}


PREFIX: list[Call] = [
    bash("ls"),
    ("read_file", {"path": "README.rst", "start_line": 1, "end_line": 12}),
    bash(INSTALL),
    bash(TEST),
    bash(f"grep -n '^def ' {RECIPES} | head -30"),
]

# name: (lines to read, old text, new text) in recipekit/recipes.py (tests/bench pins them to the file)
EDITS: dict[str, tuple[int, int, str, str]] = {
    "take": (31, 44, "    return list(islice(iterable, n))", "    return list(islice(iterable, max(n, 0)))"),
    "tail": (59, 67, "    return iter(deque(iterable, maxlen=n))", "    return iter(list(iterable)[-n:] if n else [])"),
    "quantify": (113, 120, "    return sum(map(pred, iterable))", "    return sum(1 for x in iterable if pred(x))"),
    "dotproduct": (133, 140, "    return sum(map(operator.mul, vec1, vec2))",
                   "    return sum(a * b for a, b in zip(vec1, vec2))"),
    "flatten": (143, 150, "    return chain.from_iterable(listOfLists)",
                "    return (x for xs in listOfLists for x in xs)"),
    "all_equal": (99, 110, "    g = groupby(iterable)\n    return next(g, True) and not next(g, False)",
                  "    items = list(iterable)\n    return all(x == items[0] for x in items)"),
}
WEIGHTS = [4, 3, 2, 2, 1, 1]  # agents of one group often converge on the same edit
FOLLOW_UP: list[Call] = [
    ("edit", {"path": RECIPES, "old_str": "Return first *n* items", "new_str": "Return the first *n* items"}),
    bash(TEST),
]
FINAL = bash("cd / && python3 -c 'import recipekit as m; print(m.take(2, m.tail(3, range(9))))'")


def traces(group: int, iterations: int, seed: int) -> list[list[list[Call]]]:
    """[iteration][trajectory] -> calls."""
    out = []
    for it in range(iterations):
        rng = random.Random(seed * 1000 + it)
        group_calls = []
        for _ in range(group):
            name = rng.choices(list(EDITS), WEIGHTS)[0]
            lo, hi, old, new = EDITS[name]
            calls = [*PREFIX, ("read_file", {"path": RECIPES, "start_line": lo, "end_line": hi}),
                     ("edit", {"path": RECIPES, "old_str": old, "new_str": new}), bash(TEST)]
            if rng.random() < 0.5:
                calls += FOLLOW_UP
            group_calls.append([*calls, FINAL])
        out.append(group_calls)
    return out


def think_times(plan: list[list[list[Call]]], scale: float, seed: int) -> list[list[list[float]]]:
    rng = random.Random(seed)
    return [[[rng.uniform(0.5, 2.0) * scale for _ in calls] for calls in group] for group in plan]


# --- the task ------------------------------------------------------------------------


def make_root(cfg: Config) -> Snapshot:
    """The task root: the project written into ``/task`` of a fresh workspace, a shell open there."""
    ws = Workspace.create("host", memory="2G", config=cfg)
    try:
        task_project.write(ws, TASK)
        ws.shell(cwd=TASK)
        return ws.snapshot()
    finally:
        ws.remove()


def end_state(ws: WorkspaceAPI) -> str:
    """A hash of what the trajectory left: files, installed packages, shell, processes."""
    procs = sorted(" ".join(p.cmdline) for p in ws.processes() if p.pid != 1)
    files = ws.exec(
        f"cd {TASK} && find . -name __pycache__ -prune -o -type f -print0 | sort -z | xargs -0 sha256sum"
        " && find . -name __pycache__ -prune -o -printf '%p %m\\n' | sort"
        " && ls /usr/local/lib/python3*/dist-packages | sort", timeout=120).stdout
    sid = ws.sessions.list()[0].session_id
    shell = ws.sessions.run(sid, "echo $PWD; env | grep -v '^_=' | sort", timeout=60).output
    return hashlib.sha256("\0".join([files, shell, *procs]).encode()).hexdigest()


# --- one mode ------------------------------------------------------------------------


@dataclass
class ModeRun:
    tool_s: list[float] = field(default_factory=list)
    makespan_s: list[float] = field(default_factory=list)
    results: dict[tuple[int, int], list[tuple]] = field(default_factory=dict)
    states: dict[tuple[int, int], str] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)


class _Fresh:
    """The no-cache baseline: a fresh fork of the root, every call run in it."""

    def __init__(self, root: AsyncSnapshot, tools: ToolSet) -> None:
        self._tools = tools
        self._ws = asyncio.ensure_future(root.restore(1))

    async def call(self, name: str, args: dict[str, Any]) -> Observation:
        (ws,) = await self._ws
        return await self._tools.run(ws, name, args)

    async def workspace(self) -> AsyncWorkspace:
        (ws,) = await self._ws
        return ws

    async def close(self) -> None:
        (ws,) = await self._ws
        await ws.remove()


def _result(o: Observation) -> tuple:
    return (o.output, o.exit_code, o.error, o.timed_out)


async def _trajectory(traj: Any, calls: list[Call], thinks: list[float], run: ModeRun, key: tuple[int, int],
                      tick: Any) -> None:
    results = []
    try:
        for (name, args), think in zip(calls, thinks, strict=True):
            await asyncio.sleep(think)
            t0 = time.perf_counter()
            obs = await traj.call(name, args)
            run.tool_s.append(time.perf_counter() - t0)
            results.append(_result(obs))
            tick()
        ws = await traj.workspace()
        run.states[key] = await ws.call(end_state, ws.sync)
        run.results[key] = results
    finally:
        await traj.close()


async def run_mode(mode: str, root: Snapshot, plan: list[list[list[Call]]], thinks: list[list[list[float]]],
                   progress: Progress) -> ModeRun:
    tools = ToolSet.default(workdir=TASK)
    total = sum(len(c) for group in plan for c in group)
    task = progress.add_task(f"{mode:>9}", total=total)
    run = ModeRun()
    cache = None
    if mode != "nocache":
        spec = SpeculationPolicy() if mode == "speculate" else None
        cache = PrefixCache(tools, policy=CachePolicy(snapshot_min_s=0.5), speculation=spec)
    held = 0
    aroot = AsyncSnapshot(root)
    try:
        for it, group in enumerate(plan):
            if cache is not None and it:
                cache.new_iteration()
            t0 = time.perf_counter()
            trajs = [_Fresh(aroot, tools) if cache is None else cache.start(root) for _ in group]
            await asyncio.gather(*(
                _trajectory(t, calls, thinks[it][i], run, (it, i), lambda: progress.advance(task))
                for i, (t, calls) in enumerate(zip(trajs, group, strict=True))))
            run.makespan_s.append(time.perf_counter() - t0)
            if cache is not None:
                held = max(held, cache.stats().bytes_held)
    finally:
        if cache is not None:
            st = cache.stats()
            run.cache = {"hit_rate": st.hit_rate, "hits": st.hits, "misses": st.misses,
                         "seconds_saved": st.seconds_saved, "bytes_held": held, "snapshots": st.snapshots,
                         "materialisations": st.materialisations, "replayed_calls": st.replayed_calls,
                         "divergences": st.divergences, "speculation": st.speculation}
            await cache.aclose()
    return run


# --- the whole benchmark -----------------------------------------------------------


def run(cfg: Config, *, quick: bool = False, group: int = 8, iterations: int | None = None,
        seed: int = 1) -> dict[str, Any]:
    iterations = iterations or (2 if quick else 3)
    scale = 0.6 if quick else 1.0
    plan = traces(group, iterations, seed)
    thinks = think_times(plan, scale, seed)
    root = make_root(cfg)
    runs: dict[str, ModeRun] = {}
    try:
        with Progress(console=output.err, transient=True) as progress:
            for mode in ("nocache", "cache", "speculate"):
                runs[mode] = asyncio.run(run_mode(mode, root, plan, thinks, progress))
    finally:
        root.remove()
    base = runs["nocache"]
    mismatches = []
    for mode in ("cache", "speculate"):
        for key, want in base.results.items():
            if runs[mode].results.get(key) != want:
                mismatches.append(f"{mode}: iteration {key[0]} trajectory {key[1]}: observations differ")
            if runs[mode].states.get(key) != base.states[key]:
                mismatches.append(f"{mode}: iteration {key[0]} trajectory {key[1]}: end state differs")
    expected = len(base.results) == group * iterations
    report: dict[str, Any] = {
        "project": f"{PACKAGE} {VERSION}", "group": group, "iterations": iterations, "quick": quick,
        "calls": sum(len(c) for g in plan for c in g), "think_s_mean": round(
            sum(t for g in thinks for ts in g for t in ts) / max(sum(len(ts) for g in thinks for ts in g), 1), 3),
    }
    for mode, r in runs.items():
        s = summary(r.tool_s)
        entry: dict[str, Any] = {"tool_s_p50": round(percentile(r.tool_s, 50), 6), "tool_s_p95": s["p95"],
                                 "tool_s_mean": s["mean"],
                                 "makespan_s": [round(m, 2) for m in r.makespan_s],
                                 "makespan_s_total": round(sum(r.makespan_s), 2)}
        if r.cache:
            sp = r.cache.pop("speculation")
            entry.update({k: round(v, 3) if isinstance(v, float) else v for k, v in r.cache.items()})
            if mode == "speculate":
                entry.update({"hidden_s": round(sp.hidden_s, 3), "speculations_started": sp.started,
                              "speculations_used": sp.used, "speculations_cancelled": sp.cancelled,
                              "wasted_cpu_s": round(sp.wasted_cpu_s, 3),
                              "skipped_budget": sp.skipped_budget, "skipped_think": sp.skipped_think})
        report[mode] = entry
    for stat in ("p50", "mean"):
        base_s = report["nocache"][f"tool_s_{stat}"]
        report[f"speedup_{stat}"] = {m: round(base_s / max(report[m][f"tool_s_{stat}"], 1e-6), 1)
                                     for m in ("cache", "speculate")}
    report["correct"] = expected and not mismatches and all(runs[m].cache.get("divergences", 0) == 0 for m in runs)
    report["mismatches"] = mismatches[:20]
    return report


def print_report(r: dict[str, Any]) -> None:
    modes = ("nocache", "cache", "speculate")

    def row(label: str, key: str, fmt: Any = str) -> tuple:
        return (label, *(fmt(r[m][key]) if key in r[m] else "-" for m in modes))

    ms = lambda v: f"{v * 1000:.2f} ms"  # noqa: E731
    output.print_table(
        f"bunshin bench cache: {r['project']}, group of {r['group']}, {r['iterations']} iterations, "
        f"{r['calls']} calls, think {r['think_s_mean']} s/turn",
        ["METRIC", *(m.upper() for m in modes)],
        [
            row("tool time p50", "tool_s_p50", ms),
            row("tool time p95", "tool_s_p95", ms),
            row("tool time mean", "tool_s_mean", ms),
            row("hit rate", "hit_rate", lambda v: f"{v:.0%}"),
            row("makespan per iteration (s)", "makespan_s", lambda v: " / ".join(f"{x:.1f}" for x in v)),
            row("tool seconds saved", "seconds_saved"),
            row("snapshots kept", "snapshots"),
            row("memory held by the cache", "bytes_held", output.human_bytes),
            row("speculations started / used", "speculations_started",
                lambda v: f"{v} / {r['speculate']['speculations_used']}"),
            row("seconds hidden by speculation", "hidden_s"),
            row("wasted CPU s (speculation)", "wasted_cpu_s"),
        ],
    )
    verdict = "yes: every cached path matched re-execution" if r["correct"] else "NO"
    for stat in ("p50", "mean"):
        output.out.print(f"tool time {stat} vs no cache: cache {r[f'speedup_{stat}']['cache']}x lower, "
                         f"speculate {r[f'speedup_{stat}']['speculate']}x lower")
    output.out.print(f"correct: {verdict}")
    for m in r["mismatches"]:
        output.out.print(f"  mismatch: {m}")
