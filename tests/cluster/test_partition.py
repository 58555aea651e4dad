"""A host's Ray node cut off from the rest of the Ray cluster (its GCS included) while the
head still reaches the host's server over HTTP (:class:`~tests.cluster.netcut.RayCut`)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from bunshin.cluster import Cluster, HostLimits
from bunshin.cluster.local import add_node, node_pids, ray_node
from bunshin.cluster.placement import ClusterPlacement
from bunshin.errors import InvalidArgument
from bunshin.rollout import ModeOptions, RolloutEngine, Status
from bunshin.tools import ToolOutput
from tests.rollout.test_integration import TASK, check_group, traces

from .conftest import MAX_WORKSPACES, secret_file, up
from .netcut import RayCut
from .test_fence import gc_json
from .test_rollout import HostDrill, clean, drill_policy, host, hosts_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.criu]
B_LEASE_S = 12.0


class RayDrill(HostDrill):
    """The first call of the drill from a workspace on host ``name`` cuts that host's Ray
    node (raylet, workers, the host actor; not its server) from everything else, and
    answers once Ray's GCS counts the node dead (saying whether the server still
    answered the head then) and ``placement`` gave the host up: that trajectory's next
    call is made elsewhere."""

    def __init__(self, cluster, name: str, rc) -> None:
        super().__init__(cluster, name, "ray", rc)
        self.node = ray_node(rc, name)
        self.raylet = self.node.all_processes["raylet"][0].process
        self.ray_cut = RayCut(node_pids(self.node), {self.pid})
        self.dead_after: float | None = None
        self.served_when_dead: bool | None = None
        self.placement: ClusterPlacement | None = None

    def __call__(self, ws, args, ctx) -> ToolOutput:
        if not self.done and ws.client.url == self.url:
            self.done = True
            self.ray_cut.cut()
            t0 = time.monotonic()
            wait_for(lambda: self.name not in self.cluster.live(), timeout=60)
            try:
                self.served_when_dead = httpx.get(f"{self.url}/v1/health", timeout=3).status_code == 200
            except httpx.HTTPError:
                self.served_when_dead = False
            self.dead_after = time.monotonic() - t0
            assert self.placement is not None
            wait_for(lambda: self.name in self.placement.dead, timeout=10)
        return ToolOutput("ok")


def test_a_node_cut_off_from_rays_gcs_is_given_up_and_comes_back_clean(cluster, ray_cluster, homes, tmp_path):
    """b's Ray node is cut off from the GCS mid-rollout, its server still reachable over HTTP.
    Ray counts the node dead after its health checks fail (its actor with it); the head
    gives b up (its trajectories finish elsewhere from the root, with the one-host rewards)
    and fences it; b, unable to renew its lease, stops serving and empties its home behind
    the cut. Healed: Ray ends b's old raylet (a node it counted dead does not rejoin), gc
    finds nothing left, and b started again (a new node, `cluster up`) serves in a newer
    epoch and is placed on again by the same head, from a new copy of a root."""
    import os

    import ray

    rc, root = ray_cluster
    # b's actor again, with a lease longer than Ray takes to count a node dead (~6 s with
    # the fixture's health checks): the head gives b up on Ray's word, its server answering
    old = host(cluster, "b").pid
    ray.kill(cluster.actor("b"))
    wait_for(lambda: not os.path.exists(f"/proc/{old}"), timeout=30)
    Cluster.up(home_root=root, bind="127.0.0.1", limits=HostLimits(max_workspaces=MAX_WORKSPACES),
               secret_file=secret_file(root), lease_s=B_LEASE_S)
    before = host(cluster, "b")
    drill = RayDrill(cluster, "b", rc)
    n, n2 = MAX_WORKSPACES + 2, 2 * MAX_WORKSPACES + 2
    seen: dict[str, object] = {}

    def cut_off_then_back(placement: ClusterPlacement) -> None:
        wait_for(lambda: drill.dead_after is not None, timeout=60)
        assert drill.served_when_dead and drill.dead_after < B_LEASE_S, drill.dead_after
        # the head gave b up on Ray's word, b's server still answering it
        assert placement.counters.why == {"b": "is on a Ray node the cluster counts dead"}
        # what Ray did: the node is dead, and its actor with it
        assert "b" not in cluster.live()
        with pytest.raises(InvalidArgument, match="no host 'b'"):
            cluster.actor("b")
        # what b did, cut off: its lease ran out unrenewed, so it stopped serving and
        # emptied its home (the head's fence could not reach it)
        wait_for(lambda: clean(homes["b"]), timeout=30)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{drill.url}/v1/health", timeout=3)
        assert placement.counters.revived == []  # no placement there meanwhile
        drill.ray_cut.heal()
        wait_for(lambda: drill.raylet.poll() is not None, timeout=60)  # Ray ends the node it gave up
        rc.remove_node(drill.node)  # what is left of it (its other processes)
        seen["gc"] = gc_json(homes["b"])
        add_node(rc, "b")
        up(root)
        seen["back"] = host(cluster, "b")
        wait_for(lambda: placement.counters.revived == ["b"], timeout=30)
        seen["copies"] = placement.counters.migrations

    async def group(placement: ClusterPlacement, policy, k: int):
        async with RolloutEngine("bunshin", tools=drill.tools(), options=ModeOptions(cache=False),
                                 cluster=placement) as engine:
            return await engine.run_group(TASK, policy, k)

    try:
        with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
            drill.placement = placement
            cut = asyncio.run(group(placement, drill_policy(n), n))
            cut_off_then_back(placement)
            after = asyncio.run(group(placement, traces(n2), n2))
            assert placement.counters.dead_hosts == ["b"]
            assert placement.counters.migrations == seen["copies"] + 2  # b and c get copies of the new root
    finally:
        drill.ray_cut.heal()
        if "back" not in seen:  # the next tests need b
            if drill.node in rc.worker_nodes:
                rc.remove_node(drill.node)
            add_node(rc, "b")
            up(root)
    assert [t.status for t in cut.trajectories] == [Status.COMPLETED] * n, [t.error for t in cut.trajectories]
    assert cut.rewards == [40.0 + i for i in range(n)]  # the one-host rewards
    moved = [t for t in cut.trajectories if t.placement["retries"]]
    assert moved and all(t.placement["hosts"][0] == "b" and t.placement["host"] != "b" for t in moved)
    assert all("host b died" in t.placement["events"][0] for t in moved), [t.placement for t in moved]
    assert seen["gc"]["workspaces"] == [] and seen["gc"]["snapshots"] == []  # nothing was left for gc
    assert clean(homes["b"])
    back = seen["back"]
    assert back.alive and back.epoch is not None and back.epoch > before.epoch
    check_group(after, n2)
    # a new root on a (setup once), full; b (back, emptied) and c take the rest from copies
    assert hosts_of(after) == {"a": MAX_WORKSPACES, "b": MAX_WORKSPACES, "c": 2}
