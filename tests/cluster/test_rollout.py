"""Rollouts over the cluster: the same rewards as on one host, the root built once and
copied where trajectories go, a group larger than a host spread, a host killed mid-rollout."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from bunshin.cluster.placement import ClusterPlacement
from bunshin.rollout import ModeOptions, RolloutEngine, Status
from bunshin.tools import Tool, ToolOutput, ToolSet, ToolSpec
from tests.conftest import leftovers
from tests.rollout.test_integration import TASK, check_group, traces

from .conftest import MAX_WORKSPACES

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def run(placement, mode, n, *, options=None, tools=None, groups=1):
    async def main():
        async with RolloutEngine(mode, options=options, tools=tools, cluster=placement) as engine:
            return [await engine.run_group(TASK, traces(n), n) for _ in range(groups)]
    return asyncio.run(main())


def hosts_of(group):
    out: dict[str, int] = {}
    for t in group.trajectories:
        out[t.placement["host"]] = out.get(t.placement["host"], 0) + 1
    return out


@pytest.mark.parametrize("mode, options", [
    ("bunshin", ModeOptions(speculation=False)), ("bunshin", ModeOptions(cache=False)), ("copy", None),
])
def test_a_group_larger_than_one_host_spreads_from_copies_of_one_root(cluster, homes, tmp_path, mode, options):
    n = MAX_WORKSPACES + 2
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        g1, g2 = run(placement, mode, n, options=options, groups=2)
        c = placement.counters
    for g in (g1, g2):
        check_group(g, n)  # the rewards and outputs of the one-host test
        assert all(t.placement["retries"] == 0 for t in g.trajectories)
    # setup ran once, on a; the holder took what it could, the rest went to b with one copy
    assert hosts_of(g1) == {"a": MAX_WORKSPACES, "b": 2}
    # the second group stays on the two holders (balanced by room), no new copy
    assert c.migrations == 1 and hosts_of(g2) == {"a": n // 2, "b": n // 2}
    assert c.placements == 2 * n and c.dead_hosts == []


def test_baseline_spreads_by_room_without_a_root(cluster, homes, tmp_path):
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        (g,) = run(placement, "baseline", 3)
        assert placement.counters.migrations == 0
    check_group(g, 3)
    assert hosts_of(g) == {"a": 1, "b": 1, "c": 1}


class HostDrill:
    """A tool that does ``action`` to one host's server the first time it is called from
    a workspace on that host (so mid-trajectory there): ``kill`` (SIGKILL) or ``freeze``
    (SIGSTOP: it stops answering, as behind a network partition)."""

    def __init__(self, cluster, name: str, action: str) -> None:
        self.cluster, self.name, self.action, self.done = cluster, name, action, False
        self.url = next(e.url for e in cluster.endpoints() if e.name == name)
        self.pid = next(h.pid for h in cluster.status() if h.name == name)

    def __call__(self, ws, args, ctx) -> ToolOutput:
        if not self.done and ws.client.url == self.url:
            self.done = True
            if self.action == "kill":
                import ray

                ray.get(self.cluster.actor(self.name).kill_server.remote())
            else:
                os.kill(self.pid, signal.SIGSTOP)
        return ToolOutput("ok")

    def tools(self) -> ToolSet:
        return ToolSet.default().add(Tool(ToolSpec("drill", "a fault drill", {"type": "object", "properties": {}}),
                                          self))


def drill_policy(n: int):
    import json

    from bunshin.rollout import TraceReplayPolicy, parse_traces

    return TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "steps": [
        {"think_s": 0.0, "name": "drill", "arguments": {}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "cat hello.txt setup.log; export K=7"}},
        {"think_s": 0.05, "name": "python", "arguments": {"code": f"base += {i}\nbase"}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "echo $K"}},
        {"think_s": 0.0, "name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base))"}},
    ]}) for i in range(n)]))


def run_drill(cluster, tmp_path, drill: HostDrill, task, n: int):
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        async def main():
            async with RolloutEngine("bunshin", tools=drill.tools(), options=ModeOptions(cache=False),
                                     cluster=placement) as engine:
                return await engine.run_group(task, drill_policy(n), n)
        g = asyncio.run(main())
        dead = list(placement.counters.dead_hosts)
    assert drill.done and dead == [drill.name]
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * n, [t.error for t in g.trajectories]
    assert g.rewards == [40.0 + i for i in range(n)]  # the one-host rewards
    moved = [t for t in g.trajectories if t.placement["retries"]]
    # every trajectory that was on the host moved off it, from the root, and says so
    assert moved and all(t.placement["hosts"][0] == drill.name and t.placement["host"] != drill.name
                         for t in moved)
    assert all(f"host {drill.name} died" in t.placement["events"][0] for t in moved)
    assert all(t.placement["hosts"] == [t.placement["host"]] and t.placement["host"] != drill.name
               for t in g.trajectories if t not in moved)
    return g


def test_a_host_killed_mid_rollout(cluster, homes, tmp_path):
    """b's server dies at the first step there: its trajectories start again from the root
    on another host, their calls replayed; the group completes with the one-host rewards.
    Then b comes back: what its killed server left is reclaimed and it serves again."""
    drill = HostDrill(cluster, "b", "kill")
    try:
        run_drill(cluster, tmp_path, drill, TASK, MAX_WORKSPACES + 2)
    finally:
        left_before = leftovers(homes["b"])
        removed = cluster.reclaim("b")
    assert left_before.get("records") and removed["workspaces"] == len(left_before["records"])
    assert removed["snapshots"] >= 1  # the root copy the head had placed there
    assert {k: v for k, v in leftovers(homes["b"]).items() if k != "criu"} == {}
    assert next(h for h in cluster.status() if h.name == "b").alive


def test_a_host_that_stops_answering_gets_no_more_placements(cluster, homes, tmp_path):
    """A partition from the head: b's server is frozen mid-rollout (its connections hang).
    Calls there run out of time, so does b's health check: b takes no more placements and
    its trajectories finish elsewhere."""
    drill = HostDrill(cluster, "b", "freeze")
    task = TASK.model_copy(update={"call_timeout": 2.0})
    try:
        run_drill(cluster, tmp_path, drill, task, MAX_WORKSPACES + 2)
    finally:
        os.kill(drill.pid, signal.SIGCONT)
        cluster.reclaim("b")
    assert next(h for h in cluster.status() if h.name == "b").alive


def test_a_dead_host_is_passed_over_for_the_root(cluster, homes, tmp_path):
    """a (where the root would be built) is down before the rollout: setup runs on the next
    host, a is marked dead, the group completes there."""
    import ray

    ray.get(cluster.actor("a").kill_server.remote())
    try:
        assert not next(h for h in cluster.status() if h.name == "a").alive  # `of` would leave it out
        # a head holding every host, as it was before a died: its first call there finds it dead
        with ClusterPlacement(cluster.clients(), spool=tmp_path) as placement:
            (g,) = run(placement, "bunshin", 3, options=ModeOptions(cache=False))
            assert placement.counters.dead_hosts == ["a"]
        check_group(g, 3)
        assert "a" not in hosts_of(g)
    finally:
        cluster.reclaim("a")


def test_api_groups_over_the_hosts(cluster, homes, tmp_path):
    """Two callers join one group key over HTTP: the first's trajectories go where the key
    is built, the second's next to them while there is room, then to another host (which
    builds its own root from the task); every trajectory gives the one-host answers."""
    from bunshin.cluster.groups import ClusterGroups, trajectories

    key = "cluster-api-group"
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        groups = ClusterGroups(placement)
        first = groups.join(key=key, n=3, task=TASK, speculation=False)
        shares = list(first)
        try:
            assert [(s.host, len(s.group)) for s in first] == [("a", 3)]
            outs = {}
            for i, (_, t) in enumerate(trajectories(first)):  # each call forks its workspace on a
                outs[i] = [t.call("bash", {"command": "cat hello.txt setup.log; export K=7"}).output]
            second = groups.join(key=key, n=3, task=TASK, speculation=False)
            shares += second
            # a holds the key and has room for one more (3 of its 4 slots are taken)
            assert [(s.host, len(s.group)) for s in second] == [("a", 1), ("b", 2)]
            assert groups.holders(key) == {"a", "b"}
            rewards = []
            for i, (_, t) in enumerate(trajectories(first + second)):
                if i >= 3:
                    outs[i] = [t.call("bash", {"command": "cat hello.txt setup.log; export K=7"}).output]
                outs[i].append(t.call("python", {"code": f"base += {i}\nbase"}).output)
                outs[i].append(t.call("bash", {"command": "echo $K"}).output)
                t.call("python", {"code": "open('/work/score', 'w').write(str(base))"})
                rewards.append(t.reward().reward)
            assert all(o == ["hello\nsetup-ran\n", f"{40 + i}\n", "7\n"] for i, o in outs.items()), outs
            assert rewards == [40.0 + i for i in range(6)]
        finally:
            for s in shares:
                s.group.close()
            removed = groups.remove(key)
    assert removed == ["a", "b"]
