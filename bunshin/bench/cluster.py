"""``bunshin bench cluster``: the rollout benchmark's quick workload on 1, 2 and 4 simulated hosts.

One local Ray cluster (``ray.cluster_utils``: one node per host of the largest size, one
CPU each, no dashboard) serves every size; each size starts the hosts anew, each host
with its own fresh home and tmpfs and its own ``bunshin serve``
(:meth:`bunshin.cluster.Cluster.up`), and places on the first ``k``; the head runs the engine in
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
from ..cluster.secret import ClusterSecret
from ..cluster.serve_proc import clear_home
from ..config import Config
from ..errors import InvalidArgument
from ..rollout import ModeOptions, RolloutEngine, TraceReplayPolicy
from ..runtime.container import statefs
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


def _size(k: int, nodes: list[str], work: wl.Workload, plan: Plan, cfg: Config) -> dict[str, Any]:
    """One run on the first ``k`` of the Ray cluster's simulated hosts ``nodes``."""
    root = cfg.paths.bench / f"cluster-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    names = nodes[:k]
    started = {n: Config.for_home(root / n, criu=cfg.criu) for n in nodes}  # each node's host is started
    homes = {n: started[n] for n in names}
    try:
        t_up = time.perf_counter()
        secret = ClusterSecret.create(root / "cluster.secret")  # a new cluster's own
        cluster = Cluster.up(home_root=root, bind="127.0.0.1", secret_file=secret.path,
                             limits=HostLimits(reserve_memory=None))
        up_s = time.perf_counter() - t_up
        try:
            slots = math.ceil(plan.tasks * plan.group / k)
            samplers = {n: MemorySampler(c) for n, c in homes.items()}
            clients = cluster.clients()
            for n in set(clients) - set(names):  # started, not placed on
                clients.pop(n).close()
            with ClusterPlacement(clients, limits={n: HostLimits(max_workspaces=slots) for n in names},
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
        finally:
            cluster.down()
    finally:
        for c_home in started.values():
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
        "shared_tree": shared_tree_costs(trajs, c.migrate_s / c.migrations if c.migrations else None),
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


def shared_tree_costs(trajs: list[Any], move_s: float | None) -> dict[str, Any]:
    """What one prefix tree shared by the hosts would add, and what each added hit would
    cost to serve on the host that asks, from this run's own timings.

    A call sequence made on several hosts is a miss on each host's own tree; a shared tree
    would serve it on all but one. To serve it on host ``h`` the state after the sequence
    must be there: either the node's snapshot moved from the host holding it (a saved
    snapshot carries the root's layers and memory too, so at least a root copy: ``move_s``,
    this run's mean root copy), or the sequence's suffix replayed on ``h`` from the deepest
    node ``h`` holds. A trajectory at that call on ``h`` already holds every call before it,
    so the suffix is the call itself: replaying costs what the miss did (``miss_s``), and
    only a move can save time, when the call took longer than the move."""
    def key(t: Any, i: int) -> tuple[str, ...]:
        return (t.task_id, *(f"{st.tool_call.name}:{st.tool_call.key or sorted(st.tool_call.arguments.items())}"
                             for st in t.steps[:i + 1]))

    # sequence -> host -> (when its first trajectory there started, its slowest run there: the miss)
    made: dict[tuple[str, ...], dict[str, tuple[float, float]]] = {}
    for t in trajs:
        for i, st in enumerate(t.steps):
            by_host = made.setdefault(key(t, i), {})
            host = t.placement.get("host", "")
            first, slowest = by_host.get(host, (t.timings.started_at, 0.0))
            by_host[host] = (min(first, t.timings.started_at), max(slowest, st.latency_s))
    # every host but the one that made the sequence first would have been served
    added = [lat for by_host in made.values() if len(by_host) > 1 for _, lat in sorted(by_host.values())[1:]]
    pays = [lat for lat in added if move_s is not None and lat > move_s]
    return {
        "added_hits": len(added),
        "miss_s_mean": round(statistics.fmean(added), 4) if added else 0.0,
        "miss_s_max": round(max(added), 4) if added else 0.0,
        "move_s": None if move_s is None else round(move_s, 3),
        "replay_s_mean": round(statistics.fmean(added), 4) if added else 0.0,  # the call itself: see above
        "pays_by_move": len(pays),
        "pays_by_replay": 0,
        "saved_s_at_most": round(sum(lat - move_s for lat in pays), 3) if move_s is not None else 0.0,
    }


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
    nodes = [f"h{i}" for i in range(max(plan.hosts))]
    with local_ray_cluster(nodes):
        for k in plan.hosts:
            output.err.print(f"[dim]cluster of {k} simulated host(s)[/]")
            sizes.append(_size(k, nodes, work, plan, cfg))
    base = sizes[0]["rewards"]
    for s in sizes:
        s["same_rewards_as_first"] = s.pop("rewards") == base
    added = sum(s["shared_tree"]["added_hits"] for s in sizes)
    pays = sum(s["shared_tree"]["pays_by_move"] for s in sizes)
    verdict = (f"a shared tree would add {added} hit(s); {pays} of them would pay (the call took longer than "
               "moving its node's snapshot); replaying a suffix never saves (it is the call itself)"
               if added else "a shared tree adds no hit here (no call sequence ran on two hosts)")
    output.err.print("[dim]an image moved between two hosts by digest[/]")
    return {"plan": vars(plan), "workload": work.description, "cpus": os.cpu_count(), "sizes": sizes,
            "shared_tree_pays": pays > 0, "shared_tree_verdict": verdict,
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
    output.print_table("a prefix tree shared by the hosts: the hits it adds, and what each would cost to serve",
                       ["hosts", "added hits", "their miss s (mean / max)", "move a node s", "replay s (mean)",
                        "pay by move", "saved s at most"],
                       [[s["hosts"], (st := s["shared_tree"])["added_hits"], f"{st['miss_s_mean']} / {st['miss_s_max']}",
                         "-" if st["move_s"] is None else st["move_s"], st["replay_s_mean"], st["pays_by_move"],
                         st["saved_s_at_most"]] for s in r["sizes"]])
    print(r["shared_tree_verdict"])
    mv = r["image_move"]
    output.print_table(f"an image of {mv['image_layers']} layers moved between two hosts' servers by digest",
                       ["move", "layers sent", "skipped", "MiB", "seconds", "MiB/s"],
                       [[m["move"], m["layers_sent"], m["layers_skipped"], round(m["bytes"] / MiB, 1), m["seconds"],
                         m["mib_per_s"]] for m in mv["rows"]])
