"""What every route of the server shares: the config, the token, a lock per workspace,
admission control and the idempotency keys."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from fastapi import Query

from ..api import models as m
from ..config import Config
from ..workspace import Snapshot, Workspace, WorkspaceInfo
from .admission import Admission, Limits
from .idempotency import Idempotency

T = TypeVar("T")
#: Largest file body a PUT takes.
MAX_FILE_BYTES = 1 << 30
PathQ = Annotated[str, Query(min_length=1, description="a path inside the workspace")]
ModeQ = Annotated[int | None, Query(ge=0, le=0o7777, description="file mode bits")]


class Locks:
    """One lock per workspace id, made on first use: calls that talk to a workspace's
    agent or dump it take it, so a fork never meets a command in flight."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    @contextmanager
    def held(self, ws_id: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(ws_id, threading.Lock())
        with lock:
            yield

    def lock_of(self, ws_id: str) -> threading.Lock:
        """The lock itself, for holders that are not one thread (a streamed answer)."""
        with self._guard:
            return self._locks.setdefault(ws_id, threading.Lock())

    def drop(self, ws_id: str) -> None:
        with self._guard:
            self._locks.pop(ws_id, None)


@dataclass
class ServerContext:
    config: Config
    token: str
    limits: Limits = field(default_factory=Limits)
    locks: Locks = field(default_factory=Locks)
    admission: Admission = field(init=False)
    idempotency: Idempotency = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.config, self.limits)
        self.idempotency = Idempotency(self.config)

    def ws_of(self, ws_id: str) -> Workspace:
        return Workspace.get(ws_id, config=self.config)

    def locked(self, ws_id: str, fn: Callable[[Workspace], T]) -> T:
        ws = self.ws_of(ws_id)
        with self.locks.held(ws.id):
            return fn(ws)


def workspace_out(ws: Workspace) -> m.WorkspaceOut:
    return info_out(ws.info())


def info_out(i: WorkspaceInfo) -> m.WorkspaceOut:
    """What ``bunshin ls`` shows of a workspace, on the wire."""
    return m.WorkspaceOut(id=i.id, name=i.name, image=i.image, state=i.state, pid=i.pid,
                          created_at=i.created_at, parent=i.parent, memory_limit=i.memory_limit,
                          pids_limit=i.pids_limit)


def snapshot_out(s: Snapshot) -> m.SnapshotOut:
    r = s.record
    return m.SnapshotOut(id=s.id, source=r.source, mode=r.mode, created_at=r.created_at, depth=r.depth,
                         pause_ms=r.pause_ms, size_bytes=s.size_bytes)
