"""ClusterPlacement's contract with the engine, without a cluster."""

from __future__ import annotations

import pytest

from bunshin.client import Client
from bunshin.cluster import ClusterPlacement
from bunshin.errors import InvalidArgument, Unreachable
from bunshin.rollout import RolloutEngine


def test_no_hosts_is_a_clear_error():
    with pytest.raises(Unreachable, match="no host") as e:
        ClusterPlacement({})
    assert "cluster status" in e.value.hint


def test_an_engine_takes_a_host_or_a_cluster_not_both(tmp_path):
    client = Client("http://127.0.0.1:9", token="t" * 20)
    with ClusterPlacement({"a": client}, spool=tmp_path) as placement:
        with pytest.raises(InvalidArgument, match="host or cluster") as e:
            RolloutEngine("bunshin", host=client, cluster=placement)
        assert "places workspaces itself" in e.value.hint


def test_a_host_that_does_not_answer_is_marked_dead_once(tmp_path):
    with ClusterPlacement({"a": Client("http://127.0.0.1:9", token="t" * 20)}, spool=tmp_path) as p:
        assert not p.alive("a") and not p.alive("a")
        assert p.dead == {"a"} and p.counters.dead_hosts == ["a"]
        assert [h.alive for h in p.loads(set())] == [False]


def test_its_own_spool_is_removed_a_given_one_kept(tmp_path):
    p = ClusterPlacement({"a": Client("http://127.0.0.1:9", token="t" * 20)})
    spool = p.spool
    assert spool.is_dir()
    p.close()
    assert not spool.exists()
    with ClusterPlacement({"a": Client("http://127.0.0.1:9", token="t" * 20)}, spool=tmp_path):
        pass
    assert tmp_path.is_dir()


def test_a_host_that_is_slow_to_answer_is_asked_again_before_it_is_given_up(tmp_path, monkeypatch):
    """Nothing listening: dead at once. A listener that never answers (a host cut off, or
    too busy to answer in time): asked again until DEAD_AFTER_S, then dead."""
    import socket
    import time

    from bunshin.cluster import placement as pl

    monkeypatch.setattr(pl, "HEALTH_TIMEOUT_S", 0.2)
    monkeypatch.setattr(pl, "DEAD_AFTER_S", 1.0)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections are taken by the kernel, nothing is ever answered
        port = silent.getsockname()[1]
        hosts = {"slow": Client(f"http://127.0.0.1:{port}", token="t" * 20),
                 "gone": Client("http://127.0.0.1:9", token="t" * 20)}
        with ClusterPlacement(hosts, spool=tmp_path) as p:
            t0 = time.monotonic()
            assert not p.alive("gone")
            assert time.monotonic() - t0 < 0.5
            t0 = time.monotonic()
            assert not p.alive("slow")
            assert time.monotonic() - t0 >= 1.0
            assert p.dead == {"gone", "slow"}


@pytest.mark.integration
def test_a_call_waiting_on_a_host_that_is_cut_off_ends_in_seconds(monkeypatch):
    """A call that has been sent and waits for its answer sends nothing more; when the
    host is cut off (nftables drops its port) the head's keepalive probes go unanswered
    and the call ends with a transport error, not at the client's timeout. (The probes
    are made sooner here than the defaults, 5 s idle + 3 x 2 s, so the test is quick.)"""
    import socket
    import threading
    import time

    import httpx

    from bunshin.cluster import transport
    from bunshin.cluster.transport import keepalive_transport

    from .netcut import NetCut

    for name, value in [("KEEPALIVE_IDLE_S", 1), ("KEEPALIVE_INTERVAL_S", 1), ("KEEPALIVE_COUNT", 2),
                        ("USER_TIMEOUT_S", 3)]:
        monkeypatch.setattr(transport, name, value)
    idle, interval, count, user = (transport.KEEPALIVE_IDLE_S, transport.KEEPALIVE_INTERVAL_S,
                                   transport.KEEPALIVE_COUNT, transport.USER_TIMEOUT_S)

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        accepted = []
        threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
        net = NetCut(port)
        with httpx.Client(transport=keepalive_transport(), timeout=120.0) as client:
            def cut_soon():
                while not accepted:
                    time.sleep(0.05)
                net.cut()  # the request is in; its answer never comes

            threading.Thread(target=cut_soon, daemon=True).start()
            t0 = time.monotonic()
            try:
                with pytest.raises(httpx.TransportError):
                    client.get(f"http://127.0.0.1:{port}/v1/health")
            finally:
                net.heal()
                for conn, _ in accepted:
                    conn.close()
            took = time.monotonic() - t0
    # the probes, bounded by the user timeout (120 s without them: the client's timeout)
    assert took < max(idle + interval * count, user) + 8, took
    assert took >= min(idle + interval * count, user) - 0.5, took  # ended by the probes, not sooner


class Members:
    """A membership whose Ray nodes are ``live`` (the head's view of the GCS)."""

    def __init__(self, live: set[str]) -> None:
        self.alive, self.fences = set(live), []

    def fence(self, name: str) -> int:
        self.fences.append(name)
        return len(self.fences) + 1

    def serving(self, name: str) -> int | None:
        return None

    def endpoint(self, name: str):
        return None

    def live(self) -> set[str]:
        return set(self.alive)


def test_a_host_whose_ray_node_died_is_given_up_though_its_server_answers(tmp_path, monkeypatch):
    """Nothing is asked of the hosts' servers here (they could answer): the membership
    alone says b's node is dead, and b is given up and fenced once; a stays."""
    import time

    from bunshin.cluster import placement as pl

    monkeypatch.setattr(pl, "REVIVE_S", 0.05)
    members = Members({"a", "b"})
    hosts = {n: Client("http://127.0.0.1:9", token="t" * 20) for n in "ab"}
    with ClusterPlacement(hosts, spool=tmp_path, membership=members) as p:
        p.watch()
        time.sleep(0.3)
        assert p.dead == set()
        members.alive.discard("b")
        deadline = time.monotonic() + 5
        while "b" not in p.dead:
            assert time.monotonic() < deadline, "the dead node was not seen"
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.dead == {"b"} and p.counters.dead_hosts == ["b"] and members.fences == ["b"]
        assert [h.alive for h in p.loads(set())] == [True, False]


def test_a_root_goes_to_a_host_holding_its_image_on_a_tie_of_roots_and_room(tmp_path):
    clients = {n: Client("http://127.0.0.1:9", token="t" * 20) for n in "abc"}
    with ClusterPlacement(clients, spool=tmp_path) as p:
        assert p.root_host(None, {"c"}) == "c", "no image to move to c"
        assert p.root_host(None, {"c"}) == "a", "roots still spread first"
        assert p.root_host(None) == "b"
        assert [h.holds_image for h in p.loads(set(), {"b"})] == [False, True, False]
