"""A real task root for the integration tests of the cache and speculation, on this host
or (``any_root``) also through ``bunshin serve``: the cache runs unchanged on remote
workspaces, and the same tests must pass there."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bunshin.client import Client
from bunshin.config import Config
from bunshin.server.thread import serve_in_thread
from bunshin.workspace import Snapshot, Workspace
from bunshin.workspace.protocol import SnapshotAPI

TASK_DIR = "/work/t"


@dataclass
class RealRoot:
    cfg: Config
    snapshot: SnapshotAPI


def make_root(cfg: Config) -> Snapshot:
    """A workspace with a task folder and a bash session open in it, snapshotted and removed."""
    ws = Workspace.create("host", memory="1G", config=cfg)
    try:
        ws.exec(f"mkdir -p {TASK_DIR} && printf 'hello\\n' > {TASK_DIR}/README", timeout=30)
        ws.shell(cwd=TASK_DIR)
        return ws.snapshot()
    finally:
        ws.remove()


@pytest.fixture
def real_root(no_leaks: Config) -> Iterator[RealRoot]:
    snap = make_root(no_leaks)
    yield RealRoot(no_leaks, snap)
    snap.remove()


@pytest.fixture(params=["local", "http"])
def any_root(request: pytest.FixtureRequest, no_leaks: Config) -> Iterator[RealRoot]:
    """The task root as a local snapshot, or as a remote one behind a server in this process."""
    snap = make_root(no_leaks)
    try:
        if request.param == "local":
            yield RealRoot(no_leaks, snap)
            return
        token = "cache-test-token-0123456789"
        with serve_in_thread(no_leaks, token) as url, Client(url, token=token) as client:
            yield RealRoot(no_leaks, client.snapshot(snap.id))
    finally:
        snap.remove()
