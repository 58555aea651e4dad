"""A real task root for the integration tests of the cache and speculation."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bunshin.config import Config
from bunshin.workspace import Snapshot, Workspace

TASK_DIR = "/work/t"


@dataclass
class RealRoot:
    cfg: Config
    snapshot: Snapshot


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
