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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .ray_cluster import ray_module


@contextmanager
def local_ray_cluster(names: Sequence[str]) -> Iterator[Any]:
    """A running cluster of ``names`` (one CPU each, no dashboard), ``ray.init``-ed in this
    process (namespace ``bunshin``); the ``Cluster`` object."""
    ray = ray_module()
    from ray.cluster_utils import Cluster as RayCluster

    tmp = tempfile.mkdtemp(prefix="bunshin-ray-")
    before = os.environ.get("RAY_TMPDIR")
    try:
        os.makedirs(os.path.join(tmp, "ray"))
        os.environ["RAY_TMPDIR"] = tmp
        rc = RayCluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "temp_dir": tmp,
            "resources": {f"bunshin-host-{names[0]}": 1}})
        try:
            for name in names[1:]:
                rc.add_node(num_cpus=1, temp_dir=tmp, resources={f"bunshin-host-{name}": 1})
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
