"""``bunshin bench cluster``: the rollout benchmark's quick workload on 1, 2 and 4 simulated hosts.

Each size gets its own local Ray cluster (``ray.cluster_utils``: one node per host,
one CPU each, no dashboard), each host its own home and tmpfs and its own
``bunshin serve`` (:meth:`bunshin.cluster.Cluster.up`); the head runs the engine in
bunshin mode over :class:`bunshin.cluster.ClusterPlacement`, every task's group at
once, each host taking at most ``ceil(trajectories / hosts)`` trajectories (so the
groups spread). Reported per size: makespan, memory each host's home held at its peak
(its workspaces' cgroups + its snapshot files), root copies (migrations) and the time
they took, the scheduler's time per placement, and whether the rewards match the
one-host run. Then the placement rule alone per decision, for 1 to 64 hosts.

All simulated hosts share this machine's CPUs and memory: more hosts add no cores,
so makespan shows the cluster layer's overhead, not a speed-up (see the README).
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .. import console as output
from ..cluster import Cluster, ClusterPlacement, HostLimits
from ..cluster.local import local_ray_cluster
from ..cluster.ray_cluster import ray_module
from ..cluster.scheduler import HostLoad, choose
from ..cluster.serve_proc import clear_home
from ..config import Config
from ..errors import InvalidArgument
from ..rollout import ModeOptions, RolloutEngine, TraceReplayPolicy
from ..runtime import statefs
from . import image_move
from . import workloads as wl
from .sampler import MemorySampler

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    hosts: tuple[int, ...] = (1, 2, 4)
    workload: str = "coding-lite"
    tasks: int = 2
    group: int = 8
    think_scale: float = 0.5
    speculation: bool = True

    def __post_init__(self) -> None:
        if not self.hosts or min(self.hosts) < 1 or self.tasks < 1 or self.group < 1:
            raise InvalidArgument(f"bad plan {self}", hint="hosts, tasks and group must be >= 1")
        if self.workload not in wl.NAMES + wl.EXTRA:
            raise InvalidArgument(f"unknown workload {self.workload!r}", hint=f"one of {', '.join(wl.NAMES + wl.EXTRA)}")


def _size(k: int, work: wl.Workload, plan: Plan, cfg: Config) -> dict[str, Any]:
    """One run on ``k`` simulated hosts."""
    root = cfg.paths.bench / f"cluster-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    names = [f"h{i}" for i in range(k)]
    homes = {n: Config.for_home(root / n, criu=cfg.criu) for n in names}
    try:
        with local_ray_cluster(names):
            t_up = time.perf_counter()
            cluster = Cluster.up(home_root=root, bind="127.0.0.1", key=os.urandom(32),
                                 limits=HostLimits(reserve_memory=None))
            up_s = time.perf_counter() - t_up
            slots = math.ceil(plan.tasks * plan.group / k)
            samplers = {n: MemorySampler(c) for n, c in homes.items()}
            with ClusterPlacement(cluster.clients(), limits={n: HostLimits(max_workspaces=slots) for n in names},
                                  spool=root / "spool") as placement:
                for s in samplers.values():
                    s.__enter__()
                t0 = time.perf_counter()
                try:
                    groups = asyncio.run(_rollouts(placement, work, plan))
                finally:
                    for s in samplers.values():
                        s.__exit__(None, None, None)
                makespan = time.perf_counter() - t0
                c = placement.counters
            cluster.down()
    finally:
        for c_home in homes.values():
            if c_home.home.exists():
                clear_home(c_home, release=True)
                statefs.release(c_home)
        shutil.rmtree(root, ignore_errors=True)
    trajs = [t for g in groups for t in g.trajectories]
    per_host = {n: sum(t.placement.get("host") == n for t in trajs) for n in names}
    return {
        "hosts": k, "slots_per_host": slots, "cluster_up_s": round(up_s, 2), "makespan_s": round(makespan, 3),
        "trajectories": len(trajs), "failed": sum(not t.ok for t in trajs),
        "trajectories_per_host": per_host,
        # one prefix tree per host: a group split over hosts shares its calls only within each host
        "cached_calls": sum(bool(st.observation is not None and st.observation.cached) for t in trajs for st in t.steps),
        "calls": sum(len(t.steps) for t in trajs),
        **hit_bounds(trajs),
        # what a hit saves: the mean time of a call the cache did not serve
        "miss_call_s": round(statistics.fmean(misses), 4) if (misses := [
            st.latency_s for t in trajs for st in t.steps
            if not (st.observation is not None and st.observation.cached)]) else 0.0,
        "peak_mib_per_host": {n: round(s.series.ws_peak() / MiB, 1) for n, s in samplers.items()},
        "migrations": c.migrations, "migrate_s": round(c.migrate_s, 3),
        "placements": c.placements, "place_us_per_placement": round(c.place_s / max(c.placements, 1) * 1e6, 1),
        "rewards": {f"{t.task_id}/{t.index}": t.reward for t in trajs},
    }


def hit_bounds(trajs: list[Any]) -> dict[str, int]:
    """The most calls a prefix cache could serve from what ran: every call whose call
    sequence since the task's root another trajectory also made (each distinct sequence
    run once), with one tree per host (``per_host_tree_hit_bound``) and with one tree
    shared by the hosts (``shared_tree_hit_bound``: what sharing results could add, at
    most; each such hit on another host's state would cost a snapshot copy or a replay).
    Speculation may serve calls beyond these (run ahead of the first trajectory to make them)."""
    def key(t: Any, i: int) -> tuple[str, ...]:
        return (t.task_id, *(f"{st.tool_call.name}:{st.tool_call.key or sorted(st.tool_call.arguments.items())}" for st in t.steps[:i + 1]))

    calls = sum(len(t.steps) for t in trajs)
    shared = {key(t, i) for t in trajs for i in range(len(t.steps))}
    per_host = {(t.placement.get("host"), *key(t, i)) for t in trajs for i in range(len(t.steps))}
    return {"per_host_tree_hit_bound": calls - len(per_host), "shared_tree_hit_bound": calls - len(shared)}


async def _rollouts(placement: ClusterPlacement, work: wl.Workload, plan: Plan) -> list[Any]:
    async with RolloutEngine("bunshin", options=ModeOptions(speculation=plan.speculation),
                             cluster=placement) as engine:
        return await engine.run(work.tasks, TraceReplayPolicy(work.traces), plan.group)


def scheduler_overhead(sizes: tuple[int, ...] = (1, 2, 4, 16, 64), rounds: int = 20_000) -> dict[str, float]:
    """Microseconds per placement decision of the rule alone, per cluster size."""
    out = {}
    for k in sizes:
        hosts = [HostLoad(f"h{i}", holds_root=i == 0, max_workspaces=64, free_memory=8 << 30) for i in range(k)]
        t0 = time.perf_counter()
        for _ in range(rounds):
            choose(hosts, memory=512 * MiB)
        out[str(k)] = round((time.perf_counter() - t0) / rounds * 1e6, 2)
    return out


def run(cfg: Config, plan: Plan) -> dict[str, Any]:
    ray = ray_module()
    if ray.is_initialized():
        raise InvalidArgument("this process is already connected to Ray", hint="run the benchmark on its own")
    work = wl.build(plan.workload, tasks=plan.tasks, traces=plan.group, think_scale=plan.think_scale, config=cfg)
    sizes = []
    for k in plan.hosts:
        output.err.print(f"[dim]cluster of {k} simulated host(s)[/]")
        sizes.append(_size(k, work, plan, cfg))
    base = sizes[0]["rewards"]
    for s in sizes:
        s["same_rewards_as_first"] = s.pop("rewards") == base
    output.err.print("[dim]an image moved between two hosts by digest[/]")
    return {"plan": vars(plan), "workload": work.description, "cpus": os.cpu_count(), "sizes": sizes,
            "scheduler_us_per_placement": scheduler_overhead(), "image_move": image_move.run(cfg)}


def print_report(r: dict[str, Any]) -> None:
    output.print_table(f"bench cluster: {r['plan']['workload']}, {r['plan']['tasks']} tasks x {r['plan']['group']} "
                       f"(this machine: {r['cpus']} CPUs shared by every simulated host)",
                       ["hosts", "makespan s", "per host", "peak MiB per host", "migrations", "copy s",
                        "place us", "cached calls", "bound: tree per host / shared", "failed", "same rewards"],
                       [[s["hosts"], s["makespan_s"], " ".join(str(v) for v in s["trajectories_per_host"].values()),
                         " ".join(str(v) for v in s["peak_mib_per_host"].values()), s["migrations"], s["migrate_s"],
                         s["place_us_per_placement"], f"{s['cached_calls']}/{s['calls']}",
                         f"{s['per_host_tree_hit_bound']} / {s['shared_tree_hit_bound']}", s["failed"],
                         "yes" if s["same_rewards_as_first"] else "NO"]
                        for s in r["sizes"]])
    print("the placement rule alone, us per decision by hosts: "
          + ", ".join(f"{k}: {v}" for k, v in r["scheduler_us_per_placement"].items()))
    mv = r["image_move"]
    output.print_table(f"an image of {mv['image_layers']} layers moved between two hosts' servers by digest",
                       ["move", "layers sent", "skipped", "MiB", "seconds", "MiB/s"],
                       [[m["move"], m["layers_sent"], m["layers_skipped"], round(m["bytes"] / MiB, 1), m["seconds"],
                         m["mib_per_s"]] for m in mv["rows"]])
