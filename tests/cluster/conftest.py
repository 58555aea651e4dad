"""A real multi-node Ray cluster on this machine, shared by every test of tests/cluster:
three nodes (``a``, ``b``, ``c``: each carries the resource ``bunshin-host-NAME``, one CPU,
no dashboard; Ray on a loopback address with its token authentication on), each host with its own bunshin home (so its own tmpfs) under the test's
tmp folder. Ray's health checks are shortened (:data:`RAY_CONFIG`), so a node cut off or
killed is counted dead in seconds. After the tests every home is checked for leftovers
and collected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin.config import Config
from tests.conftest import drop_state_tmpfs, leftovers

NAMES = ("a", "b", "c")
MAX_WORKSPACES = 4  # per host: small, so a group of 6 does not fit on one
LEASE_S = 8.0  # a host's lease: short, so a test sees one run out (not so short that a GCS slow to answer under load makes a host fence itself)
#: Ray's own settings: the GCS checks each raylet every 0.5 s and counts its node dead after
#: 4 checks in a row fail (1 s each); Ray's defaults (3 s, 10 s, 5) take ~30 s.
RAY_CONFIG = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
              "health_check_timeout_ms": 1000, "health_check_failure_threshold": 4}


def secret_file(homes: Path) -> Path:
    """The cluster secret of the package's cluster (made by the ``ray_cluster`` fixture)."""
    return homes / "cluster.secret"


def up(homes: Path):
    """``Cluster.up`` as the fixture starts it (again after a test stopped or lost hosts)."""
    from bunshin.cluster import Cluster, HostLimits

    return Cluster.up(home_root=homes, bind="127.0.0.1", limits=HostLimits(max_workspaces=MAX_WORKSPACES),
                      secret_file=secret_file(homes), lease_s=LEASE_S)


def home_config(root: Path, name: str) -> Config:
    return Config.for_home(root / name, criu=Config.from_env().criu)


def collect(cfg: Config) -> None:
    """What a test left on a host: removed (workspaces, snapshots, then gc)."""
    from bunshin.runtime import snapshot as rsnap
    from bunshin.runtime.container import lifecycle as container
    from bunshin.runtime.state.store import Store
    from bunshin.runtime.upkeep import gc

    with Store.open(cfg.db_path) as store:
        for rec in store.list_workspaces():
            container.destroy(cfg, store, rec)
        for snap in rsnap.list_all(store):
            rsnap.remove(cfg, store, snap)
        gc.collect(cfg, store, release=True)


@pytest.fixture(scope="package")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    """The Ray cluster (``ray.cluster_utils.Cluster``) and the folder of the hosts' homes."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root (the hosts run real workspaces)")
    pytest.importorskip("ray", reason="needs Ray: make install (the 'cluster' extra)")
    from bunshin.cluster.local import local_ray_cluster
    from bunshin.cluster.secret import ClusterSecret

    homes = tmp_path_factory.mktemp("cluster-homes")
    ClusterSecret.create(secret_file(homes))
    try:
        with local_ray_cluster(NAMES, system_config=RAY_CONFIG) as rc:
            yield rc, homes
    finally:
        left = {}
        for name in NAMES:
            cfg = home_config(homes, name)
            if not cfg.home.exists():
                continue
            found = leftovers(cfg)
            collect(cfg)
            drop_state_tmpfs(cfg)
            if found:
                left[name] = found
        assert not left, f"the cluster tests left behind: {left}"


@pytest.fixture(scope="package")
def cluster(ray_cluster):
    """``bunshin.cluster.Cluster.up`` on the three nodes (servers on loopback, at most
    ``MAX_WORKSPACES`` workspaces each, the package's cluster secret); ``down`` after the package."""
    _, homes = ray_cluster
    c = up(homes)
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def homes(ray_cluster) -> dict[str, Config]:
    """Each host's config; a test must leave no workspace or snapshot on any of them."""
    _, root = ray_cluster
    cfgs = {n: home_config(root, n) for n in NAMES}
    yield cfgs
    left = {}
    for name, cfg in cfgs.items():
        if cfg.home.exists() and (found := {k: v for k, v in leftovers(cfg).items() if k != "criu"}):
            left[name] = found
            collect(cfg)
    assert not left, f"test leaked on the hosts: {left}"
