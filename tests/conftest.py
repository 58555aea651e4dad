"""Shared fixtures: a private bunshin home for the session, and a leak check around every test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.runtime.cgroups import Layout
from bunshin.runtime.store import Store


@pytest.fixture(scope="session")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """A bunshin config private to this test session (its own tmpfs folder and cgroup names)."""
    config = Config.for_home(tmp_path_factory.mktemp("bunshin-home"), criu=Config.from_env().criu)
    yield config
    shutil.rmtree(config.tmpfs, ignore_errors=True)


def _mounts_under(path: Path) -> list[str]:
    prefix = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(prefix)]


def _netns() -> list[str]:
    try:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout.split()
    except FileNotFoundError:
        return []


def leftovers(config: Config) -> dict[str, list]:
    """Everything of ``config`` that still exists: must be empty between tests."""
    out: dict[str, list] = {}
    with Store.open(config.db_path) as store:
        out["records"] = [r.id for r in store.list_workspaces()]
    out["mounts"] = _mounts_under(config.tmpfs)
    out["cgroups"] = [str(p) for p in Layout.discover().find(config.cgroup_prefix)]
    ws_dir = config.tmpfs / "workspaces"
    out["folders"] = sorted(p.name for p in ws_dir.iterdir()) if ws_dir.is_dir() else []
    criu = subprocess.run(["pgrep", "-af", "criu"], capture_output=True, text=True).stdout.splitlines()
    out["criu"] = [ln for ln in criu if str(config.tmpfs) in ln or str(config.home) in ln]
    return {k: v for k, v in out.items() if v}


@pytest.fixture
def no_leaks(cfg: Config):
    """Fails the test if it leaves a mount, cgroup, process, folder or record behind."""
    before_netns = _netns()
    yield cfg
    left = leftovers(cfg)
    if _netns() != before_netns:
        left["netns"] = _netns()
    if left:
        from bunshin.runtime import gc

        with Store.open(cfg.db_path) as store:
            gc.collect(cfg, store)
        pytest.fail(f"test leaked: {left}")
