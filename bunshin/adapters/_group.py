"""One root per group key in this process, for adapters whose framework builds each
environment of a group on its own (from a config, with no handle to share).

The first environment of a key builds the root (a workspace, the task's setup, a
copy-on-write snapshot of it); every environment of the key, the first included,
restores its own workspace from that one snapshot, so setup runs once per group and
the group's workspaces share the root's memory and files copy-on-write. Across
processes the server's group key does the same (``Client.group``, ``POST /v1/groups``).

    roots = LocalGroups()
    (ws,) = roots.restore("task-17", build=lambda: make_root_snapshot())
    roots.release("task-17")            # removes the root snapshot (the workspaces stay)
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Callable, Sequence

from ..workspace.protocol import SnapshotAPI, WorkspaceAPI

log = logging.getLogger("bunshin.adapters")


class LocalGroups:
    """Root snapshots by group key; building a key's root happens once, under its own lock
    (other keys build meanwhile)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._roots: dict[str, SnapshotAPI] = {}

    def root(self, key: str, build: Callable[[], SnapshotAPI]) -> tuple[SnapshotAPI, bool]:
        """The root of ``key`` and whether this call built it (``build`` runs at most once
        per key until it is released; a ``build`` that raises leaves no root)."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key in self._roots:
                return self._roots[key], False
            snap = build()
            self._roots[key] = snap
            return snap, True

    def restore(self, key: str, build: Callable[[], SnapshotAPI], n: int = 1) -> Sequence[WorkspaceAPI]:
        """``n`` workspaces of the group ``key``, restored from its root (all or none)."""
        snap, _ = self.root(key, build)
        return snap.restore(n)

    def keys(self) -> list[str]:
        with self._guard:
            return sorted(self._roots)

    def release(self, key: str) -> bool:
        """Remove the root of ``key`` (its restored workspaces keep running); false if none."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            snap = self._roots.pop(key, None)
        if snap is None:
            return False
        snap.remove()
        return True

    def release_all(self) -> None:
        for key in self.keys():
            self.release(key)


def _release_at_exit(groups: LocalGroups) -> None:
    for key in groups.keys():
        try:
            groups.release(key)
        except Exception as e:  # the process is going; gc finishes the job
            log.warning("removing the root of group %r at exit failed: %s", key, e)


#: The process's groups: what environments built from a config (no handle passed) share.
#: Their roots are the process's: removed when it exits (``release`` frees one before).
GROUPS = LocalGroups()
atexit.register(_release_at_exit, GROUPS)
