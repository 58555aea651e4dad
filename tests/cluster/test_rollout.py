"""Rollouts over the cluster: the same rewards as on one host, the root built once and
copied where trajectories go, a group larger than a host spread, a host killed mid-rollout."""

from __future__ import annotations

import asyncio

import pytest

from bunshin.cluster.placement import ClusterPlacement
from bunshin.rollout import ModeOptions, RolloutEngine, Status
from bunshin.tools import Tool, ToolOutput, ToolSet, ToolSpec
from tests.conftest import leftovers
from tests.rollout.test_integration import TASK, check_group, traces

from .conftest import MAX_WORKSPACES


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


class HostKiller:
    """A tool that SIGKILLs one host's server the first time it is called from a
    workspace on that host (so mid-trajectory there)."""

    def __init__(self, cluster, name: str) -> None:
        self.cluster, self.name, self.done = cluster, name, False
        self.url = next(e.url for e in cluster.endpoints() if e.name == name)

    def __call__(self, ws, args, ctx) -> ToolOutput:
        if not self.done and ws.client.url == self.url:
            self.done = True
            import ray

            ray.get(self.cluster.actor(self.name).kill_server.remote())
        return ToolOutput("ok")


def test_a_host_killed_mid_rollout(cluster, homes, tmp_path):
    """b's server dies at the first step: its trajectories start again from the root on
    another host, their calls replayed; the group completes with the one-host rewards."""
    import json

    from bunshin.rollout import TraceReplayPolicy, parse_traces

    killer = HostKiller(cluster, "b")
    tools = ToolSet.default().add(Tool(ToolSpec("drill", "kill host b", {"type": "object", "properties": {}}),
                                       killer))
    n = MAX_WORKSPACES + 2
    policy = TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "steps": [
        {"think_s": 0.0, "name": "drill", "arguments": {}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "cat hello.txt setup.log; export K=7"}},
        {"think_s": 0.05, "name": "python", "arguments": {"code": f"base += {i}\nbase"}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "echo $K"}},
        {"think_s": 0.0, "name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base))"}},
    ]}) for i in range(n)]))
    try:
        with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
            async def main():
                async with RolloutEngine("bunshin", tools=tools, options=ModeOptions(cache=False),
                                         cluster=placement) as engine:
                    return await engine.run_group(TASK, policy, n)
            g = asyncio.run(main())
            assert placement.counters.dead_hosts == ["b"]
        assert [t.status for t in g.trajectories] == [Status.COMPLETED] * n, [t.error for t in g.trajectories]
        assert g.rewards == [40.0 + i for i in range(n)]
        moved = [t for t in g.trajectories if t.placement["retries"]]
        assert moved and all(t.placement["hosts"][0] == "b" and t.placement["host"] != "b" for t in moved)
        assert all("host b died" in t.placement["events"][0] for t in moved)
        assert all(t.placement["hosts"] == [t.placement["host"]] for t in g.trajectories if t not in moved)
    finally:
        # the host comes back: what its killed server left is reclaimed, then it serves again
        import ray

        left_before = leftovers(homes["b"])
        removed = ray.get(cluster.actor("b").reclaim.remote(), timeout=120)
    assert left_before.get("records") and removed["workspaces"] == len(left_before["records"])
    assert removed["snapshots"] >= 1  # the root copy the head had placed there
    assert {k: v for k, v in leftovers(homes["b"]).items() if k != "criu"} == {}
    assert next(h for h in cluster.status() if h.name == "b").alive
