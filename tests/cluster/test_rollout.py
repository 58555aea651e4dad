"""Rollouts over the cluster: the same rewards as on one host, the root built once and
copied where trajectories go, a group larger than a host spread, a host killed mid-rollout."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from bunshin.cluster import HostLimits
from bunshin.cluster.local import add_node, kill_node
from bunshin.cluster.placement import ClusterPlacement
from bunshin.rollout import ModeOptions, RolloutEngine, Status
from bunshin.rollout.task import RewardSpec
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.upkeep.gc import read_lease
from bunshin.tools import Tool, ToolOutput, ToolSet, ToolSpec
from tests.conftest import leftovers
from tests.rollout.test_integration import TASK, check_group, traces

from .conftest import LEASE_S, MAX_WORKSPACES, secret_file
from .netcut import NetCut

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def run(placement, mode, n, *, options=None, tools=None, groups=1, task=TASK):
    async def main():
        async with RolloutEngine(mode, options=options, tools=tools, cluster=placement) as engine:
            return [await engine.run_group(task, traces(n), n) for _ in range(groups)]
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


def test_a_group_next_to_its_image_sends_the_overflow_host_only_the_layers_it_lacks(cluster, homes, tmp_path):
    """The image is on c, its two lower layers on a, nothing on b: the root is built on c
    (the roots tie, c holds the image), the group's overflow goes to a (the tie on room
    goes by name), which is sent the two upper layers only; each row says how the image
    came to its host (nothing on c's rows)."""
    from bunshin.runtime.oci import exchange
    from bunshin.runtime.state.store import Store

    from .image_task import NAME, placed, remove_images, task

    n = MAX_WORKSPACES + 2
    try:
        with placed(tmp_path / "img", homes["c"], homes["a"]):
            with Store.open(homes["c"].db_path) as sc:
                doc = exchange.manifest(homes["c"], sc, NAME)
            with ClusterPlacement.of(cluster, spool=tmp_path / "spool") as placement:
                (g,) = run(placement, "bunshin", n, options=ModeOptions(speculation=False), task=task())
                moves = placement.images.done.moves
            check_group(g, n)  # the rewards and outputs of the one-host test, on the image
            assert hosts_of(g) == {"c": MAX_WORKSPACES, "a": 2}
            (move,) = moves
            assert (move.host, move.source, move.layers_sent, move.layers_skipped) == ("a", "c", 2, 2)
            assert move.bytes == sum(e["size"] for e in doc["layers"][2:])
            for t in g.trajectories:
                assert t.placement.get("image") == (move.to_dict() if t.placement["host"] == "a" else None)
            with Store.open(homes["a"].db_path) as sa:
                assert exchange.missing(homes["a"], sa, exchange.check_manifest(homes["a"], doc)[0]) == []
            with Store.open(homes["b"].db_path) as sb:
                assert oci_store.list_images(sb) == [], "b got nothing: no trajectory went there"
    finally:
        remove_images(homes["a"], homes["b"], homes["c"])


def test_api_groups_on_hosts_lacking_the_image_get_it_first(cluster, homes, tmp_path):
    """An HTTP group key whose task's image only c holds: the key is built on c, and the
    host its overflow joins on (a) is sent the whole image before it joins with a copy of
    c's root; a trajectory there answers from the image's layers and gets its reward."""
    from bunshin.cluster.groups import ClusterGroups, trajectories

    from .image_task import placed, remove_images, task

    key = "cluster-image-group"
    try:
        with placed(tmp_path / "img", homes["c"], None), ClusterPlacement.of(cluster, spool=tmp_path) as placement:
            groups = ClusterGroups(placement)
            shares = groups.join(key=key, n=MAX_WORKSPACES + 1, task=task(), speculation=False)
            try:
                assert [(s.host, len(s.group)) for s in shares] == [("c", MAX_WORKSPACES), ("a", 1)]
                assert [(s.image.source, s.image.layers_sent) if s.image else None for s in shares] == [None, ("c", 4)]
                host, t = trajectories(shares)[-1]
                assert host == "a"
                assert t.call("bash", {"command": "cat hello.txt setup.log /srv/marker"}).output == \
                    "hello\nsetup-ran\nfrom the image\n"
                t.call("python", {"code": "open('/work/score', 'w').write(str(base + 2))"})
                assert t.reward().reward == 42.0
            finally:
                for s in shares:
                    s.group.close()
                groups.remove(key)
    finally:
        remove_images(homes["a"], homes["b"], homes["c"])


class HostDrill:
    """A tool that does ``action`` to one host the first time it is called from a
    workspace on that host (so mid-trajectory there): ``kill`` (SIGKILL its server),
    ``node`` (kill its whole Ray node: actor, raylet, and so its server) or ``cut`` (a
    network cut between the head and its server, :class:`NetCut`)."""

    def __init__(self, cluster, name: str, action: str, rc=None) -> None:
        self.cluster, self.name, self.action, self.rc, self.done = cluster, name, action, rc, False
        self.url = next(e.url for e in cluster.endpoints() if e.name == name)
        self.pid = next(h.pid for h in cluster.status() if h.name == name)
        self.net = NetCut(int(self.url.rsplit(":", 1)[1]))

    def __call__(self, ws, args, ctx) -> ToolOutput:
        if not self.done and ws.client.url == self.url:
            self.done = True
            if self.action in ("kill", "kill-soon"):
                import ray

                kill = self.cluster.actor(self.name).kill_server.remote
                if self.action == "kill":
                    ray.get(kill())
                else:  # once this call has answered: while the next command runs there
                    threading.Timer(0.5, lambda: ray.get(kill())).start()
            elif self.action == "node":
                kill_node(self.rc, self.name)
            else:
                self.net.cut()
        return ToolOutput("ok")

    def tools(self) -> ToolSet:
        return ToolSet.default().add(Tool(ToolSpec("drill", "a fault drill", {"type": "object", "properties": {}}),
                                          self))


def drill_policy(n: int, *, last: bool = False):
    """``n`` traces; the drill is their first step, or (``last``) their last, so the host
    goes while the reward command runs."""
    import json

    from bunshin.rollout import TraceReplayPolicy, parse_traces

    drill = {"think_s": 0.0, "name": "drill", "arguments": {}}
    return TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "steps": [
        *([] if last else [drill]),
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "cat hello.txt setup.log; export K=7"}},
        {"think_s": 0.05, "name": "python", "arguments": {"code": f"base += {i}\nbase"}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "echo $K"}},
        {"think_s": 0.0, "name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base))"}},
        *([drill] if last else []),
    ]}) for i in range(n)]))


def run_drill(cluster, tmp_path, drill: HostDrill, task, n: int, *, last: bool = False, placement=None):
    own = placement is None
    placement = placement or ClusterPlacement.of(cluster, spool=tmp_path)
    try:
        async def main():
            async with RolloutEngine("bunshin", tools=drill.tools(), options=ModeOptions(cache=False),
                                     cluster=placement) as engine:
                return await engine.run_group(task, drill_policy(n, last=last), n)
        g = asyncio.run(main())
        dead = list(placement.counters.dead_hosts)
    finally:
        if own:
            placement.close()
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


def wait_for(what, timeout: float = 60.0, every: float = 0.25):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return got


def host(cluster, name: str):
    return next(h for h in cluster.status() if h.name == name)


def clean(cfg) -> bool:
    return not {k: v for k, v in leftovers(cfg).items() if k != "criu"}


def test_a_host_killed_mid_rollout_is_fenced_and_emptied(cluster, homes, tmp_path):
    """b's server dies at the first step there: its trajectories start again from the root
    on another host, their calls replayed; the group completes with the one-host rewards.
    The head fenced b's epoch: b's actor sees it, empties b's home (what the killed server
    left) and serves again in the new epoch, with no `cluster reclaim`."""
    before = host(cluster, "b")
    token = next(e.token for e in cluster.endpoints() if e.name == "b")
    drill = HostDrill(cluster, "b", "kill")
    run_drill(cluster, tmp_path, drill, TASK, MAX_WORKSPACES + 2)
    after = wait_for(lambda: (h := host(cluster, "b")).epoch == before.epoch + 1 and h.alive and h)
    assert after.fenced == before.fenced + 1 and after.pid != before.pid
    # a new token with the new epoch: the head's calls from before the fence are refused
    assert next(e.token for e in cluster.endpoints() if e.name == "b") != token
    assert clean(homes["b"])


def test_a_reward_on_a_host_that_dies_after_the_last_call_is_retried(cluster, homes, tmp_path):
    """b's server dies while the reward command runs there (the last tool call answered):
    the reward's exec is watched like a call, so the trajectory moves (its calls replayed)
    and its reward is read elsewhere."""
    drill = HostDrill(cluster, "b", "kill-soon")
    task = TASK.model_copy(update={"reward": RewardSpec(command="sleep 2; cat /work/score")})
    g = run_drill(cluster, tmp_path, drill, task, MAX_WORKSPACES + 2, last=True)
    assert any("in exec" in e for t in g.trajectories for e in t.placement["events"]), \
        [t.placement for t in g.trajectories]
    wait_for(lambda: host(cluster, "b").alive and clean(homes["b"]))


def test_a_partition_stops_placements_until_it_heals(cluster, homes, tmp_path, monkeypatch):
    """A network cut between the head and b's server mid-rollout (nftables): calls there
    hang, b's health check times out, b is fenced and takes no more placements; its
    trajectories finish elsewhere. b's actor, which still reaches the cluster, empties
    b's home behind the cut. Once the cut heals, b is placed on again by the same engine,
    its root copied there anew (the old copy went with the fence)."""
    from bunshin.cluster import placement as pl

    monkeypatch.setattr(pl, "DEAD_AFTER_S", 4.0)  # given up sooner than the default 10 s
    drill = HostDrill(cluster, "b", "cut")
    task = TASK.model_copy(update={"call_timeout": 2.0})
    n = MAX_WORKSPACES + 2
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        async def main():
            async with RolloutEngine("bunshin", tools=drill.tools(), options=ModeOptions(cache=False),
                                     cluster=placement) as engine:
                cut = await engine.run_group(task, drill_policy(n), n)
                assert f"dport {drill.net.port} drop" in drill.net.rules()
                await asyncio.to_thread(wait_for, lambda: clean(homes["b"]))  # emptied by its actor, cut off
                during = await engine.run_group(task, traces(n), n)
                revived = list(placement.counters.revived)
                drill.net.heal()
                await asyncio.to_thread(wait_for, lambda: placement.counters.revived == ["b"], 30)
                copies = placement.counters.migrations
                after = await engine.run_group(task, traces(2 * MAX_WORKSPACES + 2), 2 * MAX_WORKSPACES + 2)
                return cut, during, revived, copies, after
        try:
            cut, during, revived, copies, after = asyncio.run(main())
        finally:
            drill.net.heal()
        assert placement.counters.dead_hosts == ["b"]
        assert [t.status for t in cut.trajectories] == [Status.COMPLETED] * n, [t.error for t in cut.trajectories]
        assert cut.rewards == [40.0 + i for i in range(n)]
        assert any(t.placement["retries"] for t in cut.trajectories)
        check_group(during, n)
        assert "b" not in hosts_of(during) and revived == []  # no placement behind the cut
        check_group(after, 2 * MAX_WORKSPACES + 2)
        # a and c hold the root and are full: b takes the rest, from a new copy of the root
        assert hosts_of(after) == {"a": MAX_WORKSPACES, "c": MAX_WORKSPACES, "b": 2}
        assert placement.counters.migrations == copies + 1
    assert host(cluster, "b").alive


def test_a_node_killed_mid_rollout_and_revived_is_cleaned_by_gc(cluster, ray_cluster, homes, tmp_path):
    """b's whole Ray node dies mid-rollout (its actor with it; its server stops, leaving
    its workspaces running for a restart to adopt). The group completes elsewhere. With
    no actor renewing b's lease it runs out, and plain `bunshin gc` on b empties its home.
    The node comes back: `cluster up` starts b again in the fenced epoch, and it is placed on."""
    from bunshin.cluster import Cluster
    from tests.cluster.test_fence import gc_json

    rc, root = ray_cluster
    before = host(cluster, "b")
    drill = HostDrill(cluster, "b", "node", rc)
    try:
        run_drill(cluster, tmp_path, drill, TASK, MAX_WORKSPACES + 2)
        wait_for(lambda: not os.path.exists(f"/proc/{before.pid}"), timeout=30)
        left = leftovers(homes["b"])
        assert left.get("records")  # the server's running workspaces outlive it, as after a crash
        wait_for(lambda: (lease := read_lease(homes["b"])) is not None and lease.lost(), timeout=LEASE_S + 5)
        report = gc_json(homes["b"])
        assert sorted(report["workspaces"]) == sorted(left["records"]) and report["snapshots"]
        assert clean(homes["b"])
    finally:
        add_node(rc, "b")
        Cluster.up(home_root=root, bind="127.0.0.1", limits=HostLimits(max_workspaces=MAX_WORKSPACES),
                   secret_file=secret_file(root), lease_s=LEASE_S)
    back = host(cluster, "b")
    assert back.alive and back.epoch == before.epoch + 1  # the head's fence, kept by the cluster
    with ClusterPlacement.of(cluster, spool=tmp_path) as placement:
        (g,) = run(placement, "baseline", 3)
    check_group(g, 3)
    assert hosts_of(g) == {"a": 1, "b": 1, "c": 1}


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
    is built, the second's next to them while there is room, then to another host, which
    gets a copy of the root (no second setup) and joins with it and the task; every
    trajectory gives the one-host answers; removing the key frees the copy too."""
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
            # b's group starts from the copy of a's root loaded there, not from a setup of its own
            copy = groups.copies[(key, "b")]
            assert second[1].group.root == copy and placement.counters.migrations == 1
            assert copy in [x.id for x in placement.hosts["b"].snapshots()]
            third = groups.join(key=key, n=1, task=TASK, speculation=False)  # b joined as it was made
            shares += third
            assert [(s.host, len(s.group)) for s in third] == [("b", 1)] and placement.counters.migrations == 1
            third[0].group.close()
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
        assert removed == ["a", "b"] and groups.copies == {}
        assert placement.hosts["b"].snapshots() == []
