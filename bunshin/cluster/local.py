"""A Ray cluster of simulated hosts on this machine (``ray.cluster_utils.Cluster``), one
node per host name with the resource ``bunshin-host-NAME``: what the cluster tests and
``bunshin bench cluster`` run on.

Ray's sessions go to a private temp folder (short: Ray's socket paths must fit), and so
does the address file Ray writes for a cluster it starts: it goes to
``RAY_TMPDIR/ray/ray_current_cluster``, ``/tmp/ray`` by default, a folder nothing makes on
a fresh machine. Everything is stopped and removed on the way out, also when a node fails
to start.

Ray's own listeners bind loopback (:data:`LOCAL_IP`: given as the node address, Ray
binds its servers there alone), and Ray's token authentication is on
(``RAY_AUTH_MODE=token``, a random token in a 0600 file of that folder,
``RAY_AUTH_TOKEN_PATH``): a process of this machine without the token is refused too.
Ray's drivers take 127.0.0.1 in an address for "this machine" and dial its outside
address instead, unless told it is no multi-machine cluster
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). The variables are this process's (and its
children's) while the cluster runs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import RuntimeFailure
from .ray_cluster import RESOURCE_PREFIX, connect_ray, ray_module

#: The address a local cluster's Ray listens on.
LOCAL_IP = "127.0.0.1"
_ONE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray resolves 127.0.0.1 as itself
_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", _ONE_MACHINE)


def _reload_ray_env() -> None:
    """Make this process's Ray read the variables again (it read them once, at import)."""
    from ray._private import ray_constants
    from ray._private.authentication_test_utils import reset_auth_token_state

    reset_auth_token_state()
    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(_ONE_MACHINE) != "0"


@contextmanager
def _ray_env(folder: str) -> Iterator[None]:
    """Ray's token authentication on, with a new token, and 127.0.0.1 taken as this
    machine's address, while the block runs."""
    before = {k: os.environ.get(k) for k in _ENV}
    path = os.path.join(folder, "ray-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": path, _ONE_MACHINE: "0"})
    _reload_ray_env()
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _reload_ray_env()


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
        with _ray_env(tmp):
            yield from _run(ray, RayCluster, tmp, names, system_config)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before


def _run(ray: Any, ray_cluster: Any, tmp: str, names: Sequence[str],
         system_config: dict[str, Any] | None) -> Iterator[Any]:
    rc = ray_cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "temp_dir": tmp, "node_ip_address": LOCAL_IP,
        "resources": {f"{RESOURCE_PREFIX}{names[0]}": 1},
        **({"_system_config": system_config} if system_config else {})})
    try:
        for name in names[1:]:
            add_node(rc, name)
        rc.wait_for_nodes()
        connect_ray(rc.address)
        try:
            yield rc
        finally:
            ray.shutdown()
    finally:
        rc.shutdown()


def add_node(rc: Any, name: str) -> Any:
    """Start a node for host ``name`` in ``rc`` (inside :func:`local_ray_cluster`): a host
    coming back; its Ray node object."""
    return rc.add_node(num_cpus=1, node_ip_address=LOCAL_IP, temp_dir=os.environ["RAY_TMPDIR"],
                       resources={f"{RESOURCE_PREFIX}{name}": 1})


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
