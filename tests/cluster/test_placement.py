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
