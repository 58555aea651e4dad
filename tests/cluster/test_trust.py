"""A cluster trusts nothing it did not authenticate: a driver on the same Ray cluster
without credentials gets no token or key and cannot fence a host; what bunshin and Ray
start listens on loopback only."""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import secrets
import subprocess
import sys

import psutil
import pytest

from bunshin.cluster import fence
from bunshin.cluster.local import node_pids
from bunshin.cluster.records import SignedEndpoint

pytestmark = pytest.mark.integration

#: A driver that tries what the issue lists: connect, then read a host's endpoint (its
#: token?), write a fencing epoch, run a task (root on the node).
INTRUDER = r"""
import json, sys
import ray
address = sys.argv[1]
out = {}
try:
    ray.init(address=address, namespace="bunshin", log_to_driver=False)
except Exception as e:
    out["refused"] = f"{type(e).__name__}: {e}"[:300]
else:
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put("epoch/b", "99", overwrite=True, namespace="bunshin")
    out["kv"] = True
    out["endpoint"] = repr(ray.get(ray.get_actor(sys.argv[2], namespace="bunshin").endpoint.remote()))
    out["task"] = ray.get(ray.remote(lambda: "ran").remote())
print(json.dumps(out))
"""


def intruder(address: str, actor: str, **env: str) -> subprocess.Popen[str]:
    """The intruding driver, with no Ray credentials of this process (none in its env, an
    empty HOME: no ~/.ray/auth_token) but ``env``; Ray's connect retries shortened."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base.update(HOME="/nonexistent", RAY_gcs_server_port_wait_time_s="2", **env)  # 2 tries, not 20
    return subprocess.Popen([sys.executable, "-c", INTRUDER, address, actor], env=base, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_driver_without_rays_token_is_refused(cluster, ray_cluster):
    rc, _ = ray_cluster
    before = cluster.serving("b")
    actor = next(n.actor_name for n in cluster.nodes() if n.name == "b")
    runs = [intruder(rc.address, actor),
            intruder(rc.address, actor, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))]
    for p in runs:
        out, err = p.communicate(timeout=240)
        result = json.loads(out.strip().splitlines()[-1])
        assert set(result) == {"refused"}, result  # no endpoint read, no record written, no task run
        assert "InvalidAuthToken" in err or "Authentication" in err, err[-2000:]
    assert cluster.serving("b") == before and fence.epoch(cluster.secret, "b") == before


def test_actors_hand_out_no_token_or_key(cluster, homes):
    """What a holder of Ray's token (but not of the cluster secret) gets from every host
    actor: URLs and epochs, no server token, no snapshot key; an endpoint not signed with
    the secret gets no token from the head."""
    secret = cluster.secret
    tokens = {e.name: e.token for e in cluster.endpoints()}
    assert tokens == {h.name: secret.host_token(h.name, h.epoch) for h in cluster.status()}  # derived on the head
    key = secret.snapshot_key()
    import ray

    for name in tokens:
        actor = cluster.actor(name)
        said = pickle.dumps([ray.get(actor.endpoint.remote()), ray.get(actor.status.remote())])
        for t in tokens.values():
            assert t.encode() not in said
        assert key not in said and key.hex().encode() not in said
        assert homes[name].snapshot_key_path.read_bytes() == key  # derived on the host, from its own file
    signed = ray.get(cluster.actor("b").endpoint.remote())
    assert isinstance(signed, SignedEndpoint) and cluster._access(signed, secret) is not None
    moved = SignedEndpoint(signed.name, "http://127.0.0.1:1", signed.epoch, signed.mac)
    assert cluster._access(moved, secret) is None  # a URL the host did not sign: no token sent there


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.removeprefix("::ffff:")).is_loopback


def test_everything_started_listens_on_loopback(cluster, ray_cluster):
    """The hosts' servers, and every process of the Ray cluster bunshin started (GCS,
    raylets, workers, agents): no listener on another address."""
    rc, _ = ray_cluster
    servers = {h.pid for h in cluster.status()}
    pids = set(servers)
    for node in rc.list_all_nodes():
        for pid in node_pids(node):
            try:
                pids |= {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
            except psutil.NoSuchProcess:
                continue
    listening = []
    for pid in pids:
        try:
            listening += [(pid, c.laddr.ip) for c in psutil.Process(pid).net_connections("inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    assert servers | {rc.head_node.all_processes["gcs_server"][0].process.pid} <= {pid for pid, _ in listening}
    assert all(_loopback(ip) for _, ip in listening), [x for x in listening if not _loopback(x[1])]
