"""``bunshin bench adapters --framework skyrl``: a SkyRL-gym group of 8 on the coding task, with and
without the group fork.

The group is what SkyRL's generator makes for one prompt: ``n`` envs from
``skyrl_gym.make("bunshin", extras=row)`` with the same ``instance_id``, each driven in
its own thread (SkyRL runs ``env.init``/``env.step`` in an executor), each replaying one
of the rollout benchmark's coding traces (recipekit: list, read, ``pip install -e .``,
tests, diverging edits, re-test) as the model's text, with its think times. Side by
side, one after another, memory sampled as in ``bunshin bench rollout``:

- ``baseline``: no group fork: each env gets a fresh workspace and re-runs the setup;
- ``fork``: the copies fork from one root (setup once, copy-on-write), every call runs;
- ``fork+cache``: the same, behind the instance's prefix cache (the adapter's default);
- ``fork:served``: the same through a ``bunshin serve`` host in a thread of this process: each
  env joins the server's group key over HTTP (``env_config.url``), as generator processes would.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import console as output
from ..config import Config
from ..rollout.policies import Trace
from ..rollout.task import TaskSpec
from .framework_group import group_result, group_task, report_cells
from .rollout import settle
from .sampler import MemorySampler, idle_used
from .stats import summary

#: label -> the env_config of the bunshin SkyRL env
MODES: dict[str, dict[str, Any]] = {
    "baseline": {"mode": "baseline"},
    "fork": {"mode": "bunshin", "cache": False},
    "fork+cache": {"mode": "bunshin"},
    "fork:served": {"mode": "bunshin", "served": True},
}


@dataclass(frozen=True)
class CopyResult:
    reward: float
    env_s: float  # init: the copy's workspace (fork, or create + setup)
    total_s: float
    calls: int
    cached: int
    error: str | None


def _text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def drive(env: Any, trace: Trace) -> CopyResult:
    """One copy, as SkyRL's agent loop drives it: init, a step per model turn, close."""
    t0 = time.perf_counter()
    try:
        env.init(None)
        env_s = time.perf_counter() - t0
        out: dict[str, Any] = {}
        for step in trace.steps:
            time.sleep(step.think_s)
            out = env.step(_text(step.tool_call.name, step.tool_call.arguments))
            if out["done"]:
                break
        if not out.get("done"):
            time.sleep(trace.final_think_s)
            out = env.step(trace.final_content or "done")
        m = env.get_metrics()
        return CopyResult(float(out["reward"]), round(env_s, 3), round(time.perf_counter() - t0, 3),
                          m["tool_calls"], m["cached_calls"], out["metadata"].get("reward_error"))
    finally:
        env.close()


def run_mode(cfg: Config, label: str, task: TaskSpec, traces: list[Trace]) -> dict[str, Any]:
    import skyrl_gym

    from ..adapters import skyrl as adapter
    from ..adapters.trajectories import client, close_all

    adapter.register()
    served = MODES[label].get("served", False)
    key = f"{task.id}-{label.replace(':', '-')}-{secrets.token_hex(4)}"
    row = {"task": task.model_dump(mode="json"), "instance_id": key}
    idle = idle_used(1.0)
    with _host(cfg, served) as host, MemorySampler(cfg) as sampler:
        env_config = {**{k: v for k, v in MODES[label].items() if k != "served"}, "config": cfg, **host}
        t0 = time.perf_counter()
        try:
            envs = [skyrl_gym.make("bunshin", env_config=env_config, extras=dict(row)) for _ in traces]
            with ThreadPoolExecutor(len(envs)) as pool:
                results = list(pool.map(drive, envs, traces))
        finally:
            if served:
                client(host["url"], token=host["token"]).request("DELETE", f"/v1/groups/{key}")
            close_all()  # the instance's root and cache (and this process's clients)
        makespan = time.perf_counter() - t0
    s = sampler.series
    return {
        "label": label, "env_config": MODES[label], "makespan_s": round(makespan, 3),
        "peak_bytes": s.peak(idle), "gb_s": round(s.gb_s(idle), 3),
        "ws_peak_bytes": s.ws_peak(), "ws_gb_s": round(s.ws_gb_s(), 3),
        "env_s": summary([r.env_s for r in results]), "copy_s": summary([r.total_s for r in results]),
        "calls": sum(r.calls for r in results), "cached_calls": sum(r.cached for r in results),
        "rewards": [r.reward for r in results], "errors": [r.error for r in results if r.error],
    }


@contextmanager
def _host(cfg: Config, served: bool) -> Iterator[dict[str, Any]]:
    """Nothing, or a ``bunshin serve`` over ``cfg`` on loopback and how envs reach it."""
    if not served:
        yield {}
        return
    from ..server.thread import serve_in_thread

    token = secrets.token_hex(16)
    with serve_in_thread(cfg, token) as url:
        yield {"url": url, "token": token}


def run(cfg: Config, *, group: int = 8, think_scale: float = 0.5, workload: str = "coding",
        modes: tuple[str, ...] = tuple(MODES), settle_s: float = 2.0) -> dict[str, Any]:
    """Every mode in turn on one task of ``workload``."""
    work, task, traces = group_task(cfg, modes=modes, known=tuple(MODES), group=group, workload=workload,
                                    think_scale=think_scale, settle_s=settle_s)
    rows = []
    for label in modes:
        output.err.print(f"[dim]skyrl: {label}, group of {group}[/]")
        rows.append(run_mode(cfg, label, task, traces))
        settle(settle_s)
    return group_result("skyrl-gym", work.name, task.id, group, think_scale, rows)


def print_report(r: dict[str, Any]) -> None:
    rows = [(*report_cells(m), f"{m['cached_calls']}/{m['calls']}", " ".join(f"{x:g}" for x in m["rewards"]))
            for m in r["modes"]]
    output.print_table(f"bunshin bench adapters --framework skyrl: a group of {r['group']} on {r['workload']} ({r['task']}), "
                       f"think x{r['think_scale']}",
                       ["MODE", "PEAK MEM", "GB·S", "OWN PEAK", "MAKESPAN S", "INIT P50 S", "CACHED", "REWARDS"],
                       rows)
    output.out.print(f"same rewards in every mode: {'yes' if r['same_rewards'] else 'NO'}")
