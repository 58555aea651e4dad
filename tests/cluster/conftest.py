"""A real multi-node Ray cluster on this machine, shared by the module's tests: three
nodes (``a``, ``b``, ``c``: each carries the resource ``bunshin-host-NAME``, one CPU, no
dashboard), each host with its own bunshin home (so its own tmpfs) under the test's
tmp folder. After the tests every home is checked for leftovers and collected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin.config import Config
from tests.conftest import drop_state_tmpfs, leftovers

NAMES = ("a", "b", "c")
MAX_WORKSPACES = 4  # per host: small, so a group of 6 does not fit on one
LEASE_S = 3.0  # a host's lease: short, so a test sees one run out


def home_config(root: Path, name: str) -> Config:
    return Config.for_home(root / name, criu=Config.from_env().criu)


def collect(cfg: Config) -> None:
    """What a test left on a host: removed (workspaces, snapshots, then gc)."""
    from bunshin.runtime import container, gc
    from bunshin.runtime import snapshot as rsnap
    from bunshin.runtime.store import Store

    with Store.open(cfg.db_path) as store:
        for rec in store.list_workspaces():
            container.destroy(cfg, store, rec)
        for snap in rsnap.list_all(store):
            rsnap.remove(cfg, store, snap)
        gc.collect(cfg, store, release=True)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    """The Ray cluster (``ray.cluster_utils.Cluster``) and the folder of the hosts' homes."""
    import os

    if os.geteuid() != 0:
        pytest.skip("needs root (the hosts run real workspaces)")
    pytest.importorskip("ray", reason="needs Ray: make install (the 'cluster' extra)")
    from bunshin.cluster.local import local_ray_cluster

    homes = tmp_path_factory.mktemp("cluster-homes")
    try:
        with local_ray_cluster(NAMES) as rc:
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


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """``bunshin.cluster.Cluster.up`` on the three nodes (servers on loopback, at most
    ``MAX_WORKSPACES`` workspaces each, a shared test key); ``down`` after the module."""
    from bunshin.cluster import Cluster, HostLimits

    _, homes = ray_cluster
    c = Cluster.up(home_root=homes, bind="127.0.0.1", limits=HostLimits(max_workspaces=MAX_WORKSPACES),
                   key=b"cluster-test-key-0123456789abcde", lease_s=LEASE_S)
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
