"""A cluster host's home and its lease: plain ``bunshin gc`` removes what the cluster
no longer owns (a lease fenced or run out), and keeps a home whose lease holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bunshin import Workspace
from bunshin.runtime.upkeep.gc import ClusterLease, lease_path, read_lease, write_lease
from tests.conftest import leftovers

pytestmark = pytest.mark.integration


def gc_json(cfg) -> dict:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu)}
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "gc", "--json"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("expires_in, fenced, kept", [
    (600.0, False, True),  # renewed: the cluster vouches for it
    (None, False, True),  # parked by `cluster down`: the next `up` takes it back
    (-1.0, False, False),  # ran out: no actor renews it
    (600.0, True, False),  # the head gave the epoch up
])
def test_gc_drops_a_home_the_cluster_no_longer_owns(no_leaks, expires_in, fenced, kept):
    # the expiry is taken when the test runs, not when it is collected: a full suite runs
    # for longer than a lease made at collection would last
    lease = ClusterLease("b", 3, None if expires_in is None else time.time() + expires_in, fenced=fenced)
    ws = Workspace.create("host", memory="128M", config=no_leaks)
    try:
        ws.exec("echo x > /work/f")
        snap = ws.snapshot()
        write_lease(no_leaks, lease)
        assert read_lease(no_leaks) == lease
        report = gc_json(no_leaks)
        if kept:
            assert report["workspaces"] == [] and ws.is_alive()
            assert ws.exec("cat /work/f").stdout == "x\n"
            assert read_lease(no_leaks) == lease
        else:
            assert report["workspaces"] == [ws.id] and report["snapshots"] == [snap.id]
            assert not lease_path(no_leaks).exists()  # the home is no cluster's now
            assert leftovers(no_leaks) == {}
    finally:
        write_lease(no_leaks, None)
        for s in (snap, ws):
            try:
                s.remove()
            except Exception:
                pass


def test_a_planted_lease_is_not_followed(no_leaks, tmp_path):
    """A lease that is a symlink (or garbage) is no lease: gc keeps the home as it is."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"host": "b", "epoch": 1, "expires_at": 0, "fenced": True}))
    os.symlink(target, lease_path(no_leaks))
    try:
        assert read_lease(no_leaks) is None
        with Workspace.create("host", memory="128M", config=no_leaks) as ws:
            assert gc_json(no_leaks)["workspaces"] == [] and ws.is_alive()
        lease_path(no_leaks).unlink()
        lease_path(no_leaks).write_text("{not json")
        assert read_lease(no_leaks) is None
    finally:
        lease_path(no_leaks).unlink(missing_ok=True)


@pytest.fixture
def secret(no_leaks, tmp_path):
    """A cluster secret for a host actor on the session's home: the home's own snapshot key
    (an earlier test's) is set aside while the actor installs the cluster's, then put back."""
    from bunshin.cluster.secret import ClusterSecret

    key, aside = no_leaks.snapshot_key_path, tmp_path / "snapshot.key"
    if key.exists():
        key.rename(aside)
    try:
        yield ClusterSecret.create(tmp_path / "cluster.secret")
    finally:
        key.unlink(missing_ok=True)
        if aside.exists():
            aside.rename(key)


@pytest.fixture
def kv(monkeypatch):
    """Ray's GCS key-value store as a dict: the host actor alone, in this process."""
    from bunshin.cluster import fence

    store: dict[str, str] = {}
    monkeypatch.setattr(fence, "_get", store.get)
    monkeypatch.setattr(fence, "_put", store.__setitem__)
    return store


@pytest.mark.parametrize("lease, kv_epoch, kept, epoch", [
    (ClusterLease("h", 2, None), None, True, 2),  # parked, a new cluster: taken as it is
    (ClusterLease("h", 2, None), 2, True, 2),  # parked, the same cluster: taken as it is
    (ClusterLease("h", 2, None), 3, False, 3),  # the head fenced epoch 2 meanwhile
    (ClusterLease("h", 2, time.time() - 1), 2, False, 3),  # ran out: that epoch is over
    (ClusterLease("h", 2, time.time() - 1), None, False, 3),  # ran out, a new cluster: no one's
])
def test_a_host_starting_on_a_home_keeps_only_what_the_cluster_owns(no_leaks, kv, secret, lease, kv_epoch, kept,
                                                                     epoch):
    from bunshin.cluster import fence
    from bunshin.cluster.actor import HostActor

    ws = Workspace.create("host", memory="128M", config=no_leaks)
    write_lease(no_leaks, lease)
    if kv_epoch is not None:
        fence.set_epoch(secret, "h", kv_epoch)
    actor = None
    try:
        actor = HostActor("h", "node", str(no_leaks.home), bind="127.0.0.1", secret_file=str(secret.path))
        assert actor.epoch == epoch and fence.epoch(secret, "h") == epoch and fence.serving(secret, "h") == epoch
        assert ws.is_alive() == kept and len(actor.cleared) == (not kept)
        assert read_lease(no_leaks).epoch == epoch and not read_lease(no_leaks).lost()
        assert no_leaks.snapshot_key_path.read_bytes() == secret.snapshot_key()
        assert actor.server.token() == secret.host_token("h", epoch)
        fence.set_epoch(secret, "h", epoch + 1)  # the head fences it now: the actor sees it within a renewal or two
        deadline = time.time() + 15
        while fence.serving(secret, "h") != epoch + 1:  # emptied, then served again in the new epoch
            assert time.time() < deadline, "the fence was not seen"
            time.sleep(0.1)
        assert not ws.is_alive() and actor.epoch == epoch + 1 and actor.server.running()
        assert actor.server.token() == secret.host_token("h", epoch + 1)  # a new epoch's token
    finally:
        if actor is not None:
            actor.stop()
        write_lease(no_leaks, None)
        try:
            ws.remove()
        except Exception:
            pass


def test_a_host_cut_off_from_the_cluster_fences_itself(no_leaks, kv, secret, monkeypatch):
    """The GCS stops answering (its store raises here): no renewal, so once the lease has
    run out the actor stops its server and empties its home by itself. The GCS answers
    again: a node Ray counts dead stays out (its next actor takes the home); one Ray still
    counts alive rejoins in a new epoch (that lease's epoch is over)."""
    from bunshin.cluster import fence
    from bunshin.cluster.actor import HostActor

    monkeypatch.setattr(fence, "RENEW_S", 0.2)
    ws = Workspace.create("host", memory="128M", config=no_leaks)
    actor = None
    node_alive = [False]
    try:
        actor = HostActor("h", "node", str(no_leaks.home), bind="127.0.0.1", secret_file=str(secret.path),
                          lease_s=1.5)
        monkeypatch.setattr(actor, "_node_alive", lambda: node_alive[0])
        epoch = actor.epoch
        answers = fence._get

        def cut_off(key):
            raise ConnectionError("the GCS does not answer")

        monkeypatch.setattr(fence, "_get", cut_off)
        deadline = time.time() + 15
        while not actor.cleared:
            assert time.time() < deadline, "the lease ran out, but the host kept serving"
            time.sleep(0.1)
        assert not actor.server.running() and not ws.is_alive() and actor.cleared
        assert read_lease(no_leaks) is None or read_lease(no_leaks).lost()
        assert "lease ran out" in actor.status()["error"]
        monkeypatch.setattr(fence, "_get", answers)  # healed, but Ray gave the node up
        time.sleep(1.0)
        assert actor.lapsed and not actor.server.running()
        node_alive[0] = True  # a slow GCS, not a partition: the node is still in the cluster
        deadline = time.time() + 15
        while not actor.server.running() or actor.lapsed:
            assert time.time() < deadline, "the host did not rejoin"
            time.sleep(0.1)
        assert actor.epoch == epoch + 1 and fence.serving(secret, "h") == epoch + 1
    finally:
        if actor is not None:
            actor.stop()
        write_lease(no_leaks, None)
        try:
            ws.remove()
        except Exception:
            pass


def test_records_not_signed_with_the_cluster_secret_fence_nothing(no_leaks, kv, secret, monkeypatch, tmp_path):
    """Someone on Ray without the cluster secret writes ``epoch/h``: unsigned, a wrong MAC,
    another host's signed record, one signed with another secret, an older epoch of its
    own (replayed). The host follows none (its home and epoch stay), counts each, and the
    head does not fence on top of one."""
    from bunshin.cluster import fence
    from bunshin.cluster.actor import HostActor
    from bunshin.cluster.secret import ClusterSecret
    from bunshin.errors import Unauthorized

    monkeypatch.setattr(fence, "RENEW_S", 0.2)
    other = ClusterSecret.create(tmp_path / "other.secret")
    actor = ws = None
    try:
        actor = HostActor("h", "node", str(no_leaks.home), bind="127.0.0.1", secret_file=str(secret.path))
        fence.set_epoch(secret, "h", 2)  # a real fence first: the replay below is of epoch 1
        deadline = time.time() + 15
        while actor.epoch != 2:
            assert time.time() < deadline, "the fence was not seen"
            time.sleep(0.1)
        emptied = len(actor.cleared)
        ws = Workspace.create("host", memory="128M", config=no_leaks)
        fence.set_epoch(secret, "g", 9)
        fence.set_epoch(other, "x", 9)
        forged = {"unsigned": "9", "a wrong MAC": "9:" + "0" * 64, "another host's": kv["epoch/g"],
                  "another secret's": f"9:{other.sign('epoch', 'h', 9)}",
                  "an older one of its own": f"1:{secret.sign('epoch', 'h', 1)}"}
        for why, record in forged.items():
            before = fence.rejected()
            kv["epoch/h"] = record
            deadline = time.time() + 15
            while fence.rejected() == before:
                assert time.time() < deadline, f"{why}: not seen"
                time.sleep(0.1)
            time.sleep(0.5)
            assert actor.epoch == 2 and len(actor.cleared) == emptied and ws.is_alive(), why
        assert actor.status()["rejected"] >= len(forged)
        kv["epoch/h"] = "9"
        with pytest.raises(Unauthorized, match="not signed"):
            fence.fence(secret, "h")
        kv["serving/h"] = "9"
        assert fence.serving(secret, "h") is None  # the head does not take it for a host that emptied itself
    finally:
        if actor is not None:
            actor.stop()
        write_lease(no_leaks, None)
        if ws is not None:
            ws.remove()
