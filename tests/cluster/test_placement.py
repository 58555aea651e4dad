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
def test_a_call_waiting_on_a_host_that_is_cut_off_ends_in_seconds():
    """A call that has been sent and waits for its answer sends nothing more; when the
    host is cut off (nftables drops its port) the head's keepalive probes go unanswered
    and the call ends with a transport error, not at the client's timeout."""
    import socket
    import threading
    import time

    import httpx

    from bunshin.cluster.transport import (
        KEEPALIVE_COUNT,
        KEEPALIVE_IDLE_S,
        KEEPALIVE_INTERVAL_S,
        USER_TIMEOUT_S,
        keepalive_transport,
    )

    from .netcut import NetCut

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
    assert took < max(KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT, USER_TIMEOUT_S) + 8, took
