"""One lock per workspace for the whole process: calls that talk to a workspace's agent
or dump it hold it, so a fork never meets a command in flight, whoever makes them (an
:class:`~bunshin.workspace.aio.AsyncWorkspace` of the prefix cache, a server route,
both at once on the same workspace).

A lock is that of an implementation's workspace id: a remote workspace and the local
one it stands for (a client and a server in one process) have two locks, else the
client's call would hold the lock its own request waits for on the server.

The locks are plain :class:`threading.Lock` s, held by the thread that makes the call
(or, for a streamed answer, acquired in one thread and released in another): never
taken twice by one holder.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .protocol import WorkspaceAPI

_Key = tuple[type, str]


class WorkspaceLocks:
    """The locks of workspaces by id, each made on first use and dropped when it is removed."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[_Key, threading.Lock] = {}

    def lock_of(self, ws: WorkspaceAPI) -> threading.Lock:
        """The lock itself, for holders that are not one thread (a streamed answer)."""
        with self._guard:
            return self._locks.setdefault((type(ws), ws.id), threading.Lock())

    @contextmanager
    def held(self, ws: WorkspaceAPI) -> Iterator[None]:
        with self.lock_of(ws):
            yield

    def drop(self, ws: WorkspaceAPI) -> None:
        """Forget the lock of a removed workspace."""
        with self._guard:
            self._locks.pop((type(ws), ws.id), None)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


_LOCKS = WorkspaceLocks()


def workspace_locks() -> WorkspaceLocks:
    """The process's workspace locks (one set, shared by every caller in the process)."""
    return _LOCKS
