"""Shared fixtures: a private bunshin home for the session, and a leak check around every test."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bunshin.config import DEFAULT_TMPFS, Config
from bunshin.runtime.container import statefs
from bunshin.runtime.container.cgroups import Layout
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.state.store import Store

#: No test's DNS lookup leaves the machine: the host's resolver for egress workspaces asks
#: loopback (nothing answers: SERVFAIL) unless a test gives the test internet's DNS.
os.environ["BUNSHIN_DNS_UPSTREAM"] = "127.0.0.1"

#: The ``internet`` fixture (a test internet in a network namespace): tests/net/internet.py
pytest_plugins = ["tests.net.internet"]

_MACHINE_BEFORE = pytest.StashKey[set[str]]()

# --- what a test needs of the machine --------------------------------------------------

#: Fixtures that run the real runtime: a test using one is an integration test.
_RUNTIME_FIXTURES = {"family", "no_leaks"}


def _criu_missing() -> str | None:
    criu = Config.from_env().criu
    if not os.access(criu, os.X_OK):
        return f"needs CRIU >= 4.2 at {criu}: run `make install` (or set BUNSHIN_CRIU)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Integration tests (marked, or using a runtime fixture) skip with the reason when
    this machine cannot run them: not root, or no CRIU for the ``criu`` ones."""
    not_root = None if os.geteuid() == 0 else (
        "needs root (user and mount namespaces, overlayfs, cgroups): run the tests as root")
    no_criu = _criu_missing()
    for item in items:
        if _RUNTIME_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if not_root and (item.get_closest_marker("integration") or item.get_closest_marker("criu")):
            item.add_marker(pytest.mark.skip(reason=not_root))
        elif no_criu and item.get_closest_marker("criu"):
            item.add_marker(pytest.mark.skip(reason=no_criu))
        item.add_marker(pytest.mark.xdist_group(_worker_group(item)))


# --- running on several workers (``make test`` runs ``pytest -n 2 --dist loadgroup``) ------

#: Test packages whose tests share a package-scoped fixture (the cluster's Ray nodes): one worker runs them all.
_ONE_WORKER_PACKAGES = ("tests/cluster/",)


def _worker_group(item: pytest.Item) -> str:
    """The group a worker runs whole: the test's file (module fixtures made once), its
    package for those of ``_ONE_WORKER_PACKAGES``, or ``internet`` for every test of the
    test internet (its canaries are host routes, e.g. to 169.254.169.254: one holder at a time)."""
    if "internet" in getattr(item, "fixturenames", ()):
        return "internet"
    path = item.nodeid.split("::", 1)[0]
    return next((pkg for pkg in _ONE_WORKER_PACKAGES if path.startswith(pkg)), path)


def _on_worker() -> bool:
    """Whether this process is one of several test workers (pytest-xdist)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def _runs_workers(config: pytest.Config) -> bool:
    """Whether this process is the controller of several test workers."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def pytest_sessionstart(session: pytest.Session) -> None:
    if _runs_workers(session.config) and not os.environ.get("BUNSHIN_TEST_SHARED_MACHINE"):
        session.config.stash[_MACHINE_BEFORE] = _machine_state()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With several workers the machine-wide check runs once, over the whole run: what the
    run left that was not there before it (each worker's own home is checked per test)."""
    before = session.config.stash.get(_MACHINE_BEFORE, None)
    if before is None:
        return
    left = _machine_state() - before
    if left:
        time.sleep(0.5)  # an exiting process may still be releasing its cgroup
        left = _machine_state() - before
    if left:
        session.config.get_terminal_writer().line(f"the test run left behind: {sorted(left)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    """A bunshin config private to this test session (its own tmpfs folder and cgroup names);
    ``BUNSHIN_FORK_PRECOPY=1`` runs the session's forks with live pre-copy of every process
    it takes (16 MiB and more), ``BUNSHIN_FORK_PRECOPY=0`` without it."""
    env = Config.from_env()
    least = 0 if os.environ.get("BUNSHIN_FORK_PRECOPY") == "1" else env.fork_precopy_min_mib
    config = dataclasses.replace(Config.for_home(tmp_path_factory.mktemp("bunshin-home"), criu=env.criu),
                                 fork_precopy=env.fork_precopy, fork_precopy_min_mib=least)
    yield config
    drop_state_tmpfs(config)


def drop_state_tmpfs(config: Config) -> None:
    """Unmount and delete a test config's tmpfs (bunshin's own tmpfs stays mounted while in use)."""
    if not statefs.release(config):
        for mount in sorted(statefs.own_mounts(config), key=len, reverse=True):
            if os.path.ismount(mount):
                subprocess.run(["umount", "-l", mount], check=False)
    shutil.rmtree(config.tmpfs, ignore_errors=True)


# bunshin's tmpfs itself (DEFAULT_TMPFS, or DEFAULT_TMPFS.<tag> of a private home) is
# state, like the database: mounted on first use, it stays while its config is in use
_STATE_TMPFS = re.compile(re.escape(str(DEFAULT_TMPFS)) + r"(\.[0-9a-f]{6})?(/snapshots|/idmap/[^/]+)?")


def _mounts_under(config: Config) -> list[str]:
    return sorted(set(statefs.mounts_under(config.tmpfs)) - statefs.own_mounts(config))


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
    out["mounts"] = _mounts_under(config)
    out["cgroups"] = [str(p) for p in Layout.discover().find(config.cgroup_prefix)]
    ws_dir = config.paths.workspaces
    out["folders"] = sorted(p.name for p in ws_dir.iterdir()) if ws_dir.is_dir() else []
    with Store.open(config.db_path) as store:
        out["snapshot_records"] = [i for i, _ in store.list_objects("snapshot")]
    for sub, d in (("snapshots", config.paths.snapshots), ("mem", config.paths.mem)):
        out[sub] = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    layers = config.paths.layers
    # the agent and mask layers are shared, built once per session; anything else is a leak
    out["layers"] = sorted(
        p.name for p in (layers.iterdir() if layers.is_dir() else [])
        if not p.name.startswith(("agent-", "mask-"))
    )
    from bunshin.runtime.net import egress, slots

    with Store.open(config.db_path) as store:
        out["net_slots"] = sorted(slots.held(store))
        out["net_resolver"] = [d for _, d in store.list_objects("netresolver")]  # stopped with the last slot
    out["veths"], out["nft_tables"] = egress.leftovers(config, set())  # this home's links and tables
    criu = subprocess.run(["pgrep", "-af", "criu"], capture_output=True, text=True).stdout.splitlines()
    out["criu"] = [ln for ln in criu if str(config.tmpfs) in ln or str(config.home) in ln]
    return {k: v for k, v in out.items() if v}


@pytest.fixture
def no_leaks(cfg: Config):
    """Fails the test if it leaves a mount, cgroup, process, folder, record, snapshot or layer behind."""
    before_netns = _netns()
    yield cfg
    left = leftovers(cfg)
    if _netns() != before_netns:
        left["netns"] = _netns()
    if left:
        from bunshin.runtime.container import lifecycle as container
        from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
        from bunshin.runtime.snapshot import sweeping as rsnap_sweeping
        from bunshin.runtime.upkeep import gc

        with Store.open(cfg.db_path) as store:
            for rec in store.list_workspaces():  # live leftovers too: gc only takes stale ones
                container.destroy(cfg, store, rec)
            owners = {s.id: _process(s.owner_pid) for s in rsnap_lifetime.list_all(store) if s.owner_pid}
            if owners:
                left["snapshot_owners"] = owners
            for snap in rsnap_lifetime.list_all(store):  # kept snapshots too: the next test starts clean
                rsnap_sweeping.remove(cfg, store, snap)
            for snap in rsnap_lifetime.list_all(store):  # still owned (a live maker): deleted all the same
                rsnap_sweeping._delete(cfg, store, snap)
            gc.collect(cfg, store)
        pytest.fail(f"test leaked: {left}")


def _process(pid: int) -> str:
    """Who ``pid`` is now, for a leak report (it may be dead, or reused)."""
    try:
        proc = psutil.Process(pid)
        return f"{pid} (alive, {'this test run' if pid == os.getpid() else ' '.join(proc.cmdline())[:200]}, " \
               f"started {time.time() - proc.create_time():.0f} s ago)"
    except psutil.Error:
        return f"{pid} (gone)"


def _machine_state() -> set[str]:
    """Every mount, cgroup folder and criu process on the machine that names bunshin."""
    found = set()
    found.update(f"mount {mp}" for mp in mountinfo.mount_points()
                 if "bunshin" in mp.lower() and not _STATE_TMPFS.fullmatch(mp))
    for root in Path("/sys/fs/cgroup").iterdir():
        for dirpath, dirnames, _ in os.walk(root):
            for d in list(dirnames):
                if "bunshin" in d.lower():
                    found.add(f"cgroup {dirpath}/{d}")
                    dirnames.remove(d)
    ps = subprocess.run(["pgrep", "-af", "criu (dump|restore|pre-dump)"], capture_output=True, text=True).stdout
    found.update(f"criu {ln}" for ln in ps.splitlines() if "bunshin" in ln)
    return found


@pytest.fixture(autouse=True)
def _machine_left_clean():
    """Every test, whatever config it used, must leave no new bunshin mount, cgroup or criu process.

    Machine-wide, so it assumes one test run at a time (as in CI). Set
    BUNSHIN_TEST_SHARED_MACHINE=1 when several runs share a machine. With several workers
    (``-n``) it runs once over the whole run instead (``pytest_sessionfinish``).
    """
    if os.environ.get("BUNSHIN_TEST_SHARED_MACHINE") or _on_worker():  # workers: checked once, at the end
        yield
        return
    before = _machine_state()
    yield
    left = _machine_state() - before
    if left:
        time.sleep(0.5)  # an exiting process may still be releasing its cgroup
        left = _machine_state() - before
    assert not left, f"test left behind: {sorted(left)}"


@pytest.fixture
def family(no_leaks):
    """A ``Family`` of workspaces and snapshots, all removed after the test."""
    from tests.workspace.fixtures import Family

    fam = Family(no_leaks)
    try:
        yield fam
    finally:
        fam.close()
