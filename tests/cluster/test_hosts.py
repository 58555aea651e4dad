"""One host actor per Ray node, each owning that node's ``bunshin serve`` with its own home."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from bunshin.cluster.serve_proc import install_key
from bunshin.config import Config
from bunshin.errors import InvalidArgument

from .conftest import MAX_WORKSPACES, NAMES, secret_file, up


def test_a_host_per_node_with_its_own_home_and_token(cluster, homes):
    hosts = cluster.status()
    assert [h.name for h in hosts] == list(NAMES)
    assert all(h.alive and h.error is None for h in hosts), [h.error for h in hosts]
    assert len({h.node_id for h in hosts}) == len(NAMES)  # one per node, not three on one
    assert len({h.url for h in hosts}) == len(NAMES)
    for h in hosts:
        assert h.home == str(homes[h.name].home)
        assert h.limits.max_workspaces == MAX_WORKSPACES
        assert h.free_memory > 0 and h.total_memory >= h.free_memory and h.workspaces == 0
        assert os.path.exists(f"/proc/{h.pid}")
        # the cluster's key (derived from its secret) was put into the home before the server started
        assert homes[h.name].snapshot_key_path.read_bytes() == cluster.secret.snapshot_key()
    tokens = {e.name: e.token for e in cluster.endpoints()}
    assert len(set(tokens.values())) == len(NAMES)  # each server has its own token
    for e in cluster.endpoints():
        assert e.token not in repr(e)
        assert httpx.get(f"{e.url}/v1/workspaces", timeout=5).status_code == 401  # no token: refused
        other = next(t for n, t in tokens.items() if n != e.name)
        assert httpx.get(f"{e.url}/v1/workspaces", headers={"Authorization": f"Bearer {other}"},
                         timeout=5).status_code == 401  # another host's token: refused


def test_status_counts_what_each_host_holds(cluster, homes):
    clients = cluster.clients()
    try:
        ws = clients["b"].create(memory="256M")
        snap = ws.snapshot()
        try:
            by_name = {h.name: h for h in cluster.status()}
            assert by_name["b"].workspaces == 1 and by_name["b"].snapshots == [snap.id]
            assert by_name["a"].workspaces == 0 and by_name["a"].snapshots == []
        finally:
            snap.remove()
            ws.remove()
    finally:
        for c in clients.values():
            c.close()


def test_up_again_starts_nothing_new_and_cli_status_json(cluster, ray_cluster):
    from bunshin.cluster import Cluster

    rc, homes = ray_cluster
    before = {h.name: h.pid for h in cluster.status()}
    again = Cluster.up(home_root=homes, bind="127.0.0.1", secret_file=secret_file(homes))
    assert {h.name: h.pid for h in again.status()} == before
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "cluster", "status", "--json",
                          "--address", rc.address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hosts = json.loads(out.stdout)["hosts"]
    assert [(h["name"], h["pid"], h["alive"]) for h in hosts] == [(n, before[n], True) for n in NAMES]
    assert "token" not in out.stdout


def test_nodes_sharing_a_machine_need_homes_of_their_own(cluster, ray_cluster):
    from bunshin.cluster import Cluster

    before = {h.name: h.pid for h in cluster.status()}
    with pytest.raises(InvalidArgument, match="share its BUNSHIN_HOME") as e:
        Cluster.up(bind="127.0.0.1", secret_file=secret_file(ray_cluster[1]))
    assert "--home-root" in e.value.hint
    assert {h.name: h.pid for h in cluster.status()} == before  # nothing started or stopped


def test_a_home_with_another_key_is_refused(tmp_path):
    cfg = Config.for_home(tmp_path / "h")
    install_key(cfg, b"k" * 32)
    install_key(cfg, b"k" * 32)  # the same key again: fine
    assert cfg.snapshot_key_path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(InvalidArgument, match="another snapshot key") as e:
        install_key(cfg, b"x" * 32)
    assert "home of its own" in e.value.hint
    assert cfg.snapshot_key_path.read_bytes() == b"k" * 32  # untouched
    with pytest.raises(InvalidArgument, match="32 bytes"):
        install_key(cfg, b"short")


def test_no_ray_cluster_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "cluster", "status", "--address",
                          "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 125
    assert "no Ray cluster at 127.0.0.1:1" in out.stderr and "ray start --head" in out.stderr


def test_down_stops_every_server_and_status_says_so(cluster, ray_cluster):
    """The CLI's down stops the servers the fixture started; ``up`` starts them again, on
    the homes as they were (the cluster is shared by the package's tests)."""
    rc, homes = ray_cluster
    pids = [h.pid for h in cluster.status()]
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "cluster", "down", "--json",
                          "--address", rc.address], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"stopped": list(NAMES)}
    for pid in pids:  # gone, not left running without an owner
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()
    hosts = cluster.status()
    assert [h.alive for h in hosts] == [False] * len(NAMES)
    assert all("bunshin cluster up" in h.error for h in hosts)
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "cluster", "status", "--address", rc.address],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1  # not every host is serving
    up(homes)
    back = cluster.status()
    assert [h.alive for h in back] == [True] * len(NAMES) and not {h.pid for h in back} & set(pids)


def test_cluster_init_makes_a_secret_only_its_owner_reads(tmp_path):
    from bunshin.cluster.secret import ClusterSecret
    from bunshin.errors import NotFound

    path = tmp_path / "etc" / "cluster.secret"
    cli = [sys.executable, "-m", "bunshin.cli.main", "cluster", "init", "--secret-file", str(path), "--json"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"secret_file": str(path)}
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) == 32
    made = path.read_bytes()
    again = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert again.returncode == 125 and "exists" in again.stderr and path.read_bytes() == made  # never replaced
    a, b = ClusterSecret.load(path), ClusterSecret.create(tmp_path / "other")
    assert a.host_token("a", 1) != a.host_token("a", 2) != a.host_token("b", 2)  # per host and epoch
    assert a.snapshot_key() != b.snapshot_key() and len(a.snapshot_key()) == 32
    assert made.hex() not in repr(a)
    path.chmod(0o644)
    with pytest.raises(InvalidArgument, match="readable by others"):
        ClusterSecret.load(path)
    path.chmod(0o600)
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(InvalidArgument, match="symlink"):
        ClusterSecret.load(tmp_path / "link")
    with pytest.raises(NotFound, match="no cluster secret") as e:
        ClusterSecret.load(tmp_path / "missing")
    assert "bunshin cluster init" in e.value.hint


def test_servers_bind_loopback_unless_the_operator_names_an_interface():
    from bunshin.cluster.ray_cluster import Node, _bind_for
    from bunshin.cluster.serve_proc import resolve_bind

    one = [Node("n1", "a", "10.0.0.1"), Node("n2", "b", "10.0.0.1")]
    two = [Node("n1", "a", "10.0.0.1"), Node("n2", "b", "10.0.0.2")]
    assert _bind_for(None, one) == {"n1": "127.0.0.1", "n2": "127.0.0.1"}
    with pytest.raises(InvalidArgument, match="on 2 machines") as e:
        _bind_for(None, two)
    assert "--bind IFACE" in e.value.hint
    assert _bind_for("ray", two) == {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert _bind_for("wg0", two) == {"n1": "wg0", "n2": "wg0"}  # resolved on each node
    assert resolve_bind("lo") == "127.0.0.1" and resolve_bind("::1") == "::1"
    with pytest.raises(InvalidArgument, match="neither an IP address nor an interface"):
        resolve_bind("no-such-if0")


def test_up_refuses_a_ray_cluster_that_does_not_authenticate(cluster, ray_cluster, monkeypatch):
    from bunshin.cluster import Cluster
    from bunshin.cluster import ray_cluster as rcmod
    from bunshin.errors import Unauthorized

    before = {h.name: h.pid for h in cluster.status()}
    monkeypatch.setattr(rcmod, "ray_auth_enabled", lambda: False)  # as a driver that connected without a token
    with pytest.raises(Unauthorized, match="does not authenticate") as e:
        Cluster.up(home_root=ray_cluster[1], bind="127.0.0.1", secret_file=secret_file(ray_cluster[1]))
    assert "RAY_AUTH_MODE=token" in e.value.hint
    assert {h.name: h.pid for h in cluster.status()} == before  # nothing started or stopped
