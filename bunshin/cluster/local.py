"""A Ray cluster of simulated hosts on this machine (``ray.cluster_utils.Cluster``), one
node per host name with the resource ``bunshin-host-NAME``: what the cluster tests and
``bunshin bench cluster`` run on.

Ray's sessions go to a private temp folder (short: Ray's socket paths must fit), and so
does the address file Ray writes for a cluster it starts: it goes to
``RAY_TMPDIR/ray/ray_current_cluster``, ``/tmp/ray`` by default, a folder nothing makes on
a fresh machine. Everything is stopped and removed on the way out, also when a node fails
to start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import RuntimeFailure
from .ray_cluster import RESOURCE_PREFIX, ray_module


@contextmanager
def local_ray_cluster(names: Sequence[str], *, system_config: dict[str, Any] | None = None) -> Iterator[Any]:
    """A running cluster of ``names`` (one CPU each, no dashboard), ``ray.init``-ed in this
    process (namespace ``bunshin``); the ``Cluster`` object. ``system_config``: Ray's own
    settings for the whole cluster (e.g. its health-check timeouts, shortened in tests)."""
    ray = ray_module()
    from ray.cluster_utils import Cluster as RayCluster

    tmp = tempfile.mkdtemp(prefix="bunshin-ray-")
    before = os.environ.get("RAY_TMPDIR")
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        os.environ["RAY_TMPDIR"] = tmp
        rc = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "temp_dir": tmp,
            "resources": {f"{RESOURCE_PREFIX}{names[0]}": 1},
            **({"_system_config": system_config} if system_config else {})})
        try:
            for name in names[1:]:
                add_node(rc, name)
            rc.wait_for_nodes()
            ray.init(address=rc.address, namespace="bunshin", log_to_driver=False)
            try:
                yield rc
            finally:
                ray.shutdown()
        finally:
            rc.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before


def add_node(rc: Any, name: str) -> Any:
    """Start a node for host ``name`` in ``rc`` (inside :func:`local_ray_cluster`): a host
    coming back; its Ray node object."""
    return rc.add_node(num_cpus=1, temp_dir=os.environ["RAY_TMPDIR"], resources={f"{RESOURCE_PREFIX}{name}": 1})


def kill_node(rc: Any, name: str, *, timeout: float = 60.0) -> None:
    """Stop the (non-head) node of host ``name`` as a machine that goes down: its raylet
    goes and its workers are killed (the host actor with them; its server, told by the
    kernel, stops). Returns once the cluster counts the node dead."""
    from .ray_cluster import live_nodes

    ray = ray_module()
    node = ray_node(rc, name)
    node_id = node.node_id
    rc.remove_node(node)
    deadline = time.monotonic() + timeout
    while any(n.node_id == node_id for n in live_nodes(ray)):
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"Ray still counts host {name}'s node alive {timeout:g} s after it was stopped",
                                 hint="see the Ray session's logs (RAY_TMPDIR)")
        time.sleep(0.2)


def ray_node(rc: Any, name: str) -> Any:
    """The live (non-head) Ray node object of host ``name`` in ``rc``."""
    from .ray_cluster import live_nodes

    node_id = next(n.node_id for n in live_nodes(ray_module()) if n.name == name)
    return next(n for n in rc.list_all_nodes() if n.node_id == node_id)


def node_pids(node: Any) -> list[int]:
    """The processes a Ray node object started (its raylet, and the log monitor of a head)."""
    return [p.process.pid for procs in node.all_processes.values() for p in procs if p.process is not None]
