"""``Family``: the workspaces and snapshots one test makes, all removed at the end
(the ``family`` fixture of ``tests/conftest.py``)."""

from __future__ import annotations

import contextlib

from bunshin.errors import BunshinError, WorkspaceNotFound
from bunshin.workspace import Snapshot, Workspace


class Family:
    """Creates workspaces and snapshots and removes all of them at the end, whatever happened."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.workspaces: list[Workspace] = []
        self.snapshots: list[Snapshot] = []

    def create(self, **kw) -> Workspace:
        kw.setdefault("memory", "1G")
        ws = Workspace.create("host", config=self.cfg, **kw)
        self.workspaces.append(ws)
        return ws

    def fork(self, ws: Workspace, n: int = 1, **kw) -> list[Workspace]:
        clones = ws.fork(n, **kw)
        self.workspaces += clones
        return clones

    def snapshot(self, ws: Workspace) -> Snapshot:
        snap = ws.snapshot()
        self.snapshots.append(snap)
        return snap

    def restore(self, snap: Snapshot, n: int = 1) -> list[Workspace]:
        clones = snap.restore(n)
        self.workspaces += clones
        return clones

    def close(self) -> None:
        for ws in reversed(self.workspaces):
            with contextlib.suppress(WorkspaceNotFound):
                Workspace.get(ws.id, config=self.cfg).remove()
        for snap in self.snapshots:
            with contextlib.suppress(BunshinError):  # gone already, or broken by the test's attack
                Snapshot.get(snap.id, config=self.cfg).remove()

