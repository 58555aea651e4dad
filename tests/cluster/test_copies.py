"""Root copies on the hosts are leased to the head that made them: kept while it lives
(renewed), freed by the hosts' servers once it is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bunshin.cluster.copies import CopyLeases
from bunshin.errors import NotFound

from .conftest import secret_file
from .test_rollout import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.criu]
COPY_TTL_S = 3.0
KEY = "copies-of-a-dead-head"

#: A head in a process of its own: joins a group key of 6 over the hosts (4 on a, 2 on b
#: from a copy of a's root), says which copies it made, then waits to be killed.
DRIVER = f"""
import json, sys, time
from bunshin.cluster import Cluster, ClusterPlacement
from bunshin.cluster.groups import ClusterGroups
from tests.rollout.test_integration import TASK

placement = ClusterPlacement.of(Cluster.connect(sys.argv[1], secret_file=sys.argv[2]), copy_ttl={COPY_TTL_S})
groups = ClusterGroups(placement)
groups.join(key={KEY!r}, n=6, task=TASK, speculation=False)
print(json.dumps({{h: c for (_, h), c in groups.copies.items()}}), flush=True)
time.sleep(600)
"""


def snapshots(cluster, name: str) -> set[str]:
    clients = cluster.clients()
    try:
        return {s.id for s in clients[name].snapshots()}
    finally:
        for c in clients.values():
            c.close()


def test_a_root_copy_outlives_a_killed_head_only_by_its_lease(cluster, ray_cluster, homes):
    rc, root = ray_cluster
    head = subprocess.Popen([sys.executable, "-c", DRIVER, rc.address, str(secret_file(root))],
                            stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = head.stdout.readline() if head.stdout else ""
        assert line, f"the head process ended (exit {head.poll()})"
        copies = json.loads(line)
        assert list(copies) == ["b"]
        copy = copies["b"]
        time.sleep(2 * COPY_TTL_S)  # the live head renews it past its lease
        assert copy in snapshots(cluster, "b")
        head.send_signal(signal.SIGKILL)
        head.wait(30)
        t0 = time.monotonic()
        wait_for(lambda: copy not in snapshots(cluster, "b"), timeout=COPY_TTL_S + 15)
        assert time.monotonic() - t0 < COPY_TTL_S + 10
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
        clients = cluster.clients()
        try:  # the groups the dead head joined (not leased: the servers' own records)
            for name in ("a", "b"):
                try:
                    clients[name].request("DELETE", f"/v1/groups/{KEY}", default_wait=False)
                except NotFound:
                    pass
        finally:
            for c in clients.values():
                c.close()


class Answers:
    """A host client that records renewals; ``gone`` snapshots answer 404."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.gone: set[str] = set()

    def request(self, method: str, path: str, *, json=None, default_wait=True):
        self.calls.append((method, path, json))
        if path.split("/")[3] in self.gone:
            raise NotFound("no such snapshot")


def test_copy_leases_renew_what_is_held_and_forget_what_is_gone():
    a, b = Answers(), Answers()
    leases = CopyLeases({"a": a, "b": b}, ttl=30.0)
    try:
        leases.add("a", "s1")
        leases.add("b", "s2")
        b.gone.add("s2")
        leases.renew()
        assert a.calls == [("PUT", "/v1/snapshots/s1/ttl", {"ttl": 30.0})]
        assert leases.held == {("a", "s1")}  # s2 is gone from b: forgotten
        leases.drop("a", "s1")
        leases.renew()
        assert len(a.calls) == 1
    finally:
        leases.close()
