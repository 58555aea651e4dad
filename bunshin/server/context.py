"""What every route of the server shares: the config, the token, a lock per workspace,
admission control, the idempotency keys and the workspaces' leases."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import anyio.from_thread
from fastapi import Query, Request

from ..api import models as m
from ..config import Config
from ..errors import InvalidArgument
from ..runtime.kernel.limits import (
    MAX_FILE_BYTES as MAX_FILE_BYTES,  # the server's file bodies, both ways
)
from ..runtime.net.policy import NetworkMode
from ..workspace import Snapshot, Workspace, WorkspaceInfo
from ..workspace.locks import WorkspaceLocks, workspace_locks
from .admission import Admission, Limits
from .idempotency import Idempotency
from .leases import Leases, snapshot_leases
from .shares import SANDBOX_THREADS, THREADS, Shares
from .uploads import Uploads

log = logging.getLogger("bunshin.server")
T = TypeVar("T")
#: ``max_body_size`` of a route that streams its body and bounds it itself (the app's is
#: for JSON bodies: ``app.MAX_JSON_BODY``).
RAW_BODY = 1 << 62
#: Pieces a file body is read and written in: the host holds one at a time.
STREAM_CHUNK = 1 << 20
PathQ = Annotated[str, Query(min_length=1, description="a path inside the workspace")]
ModeQ = Annotated[int | None, Query(ge=0, le=0o7777, description="file mode bits")]
OffsetQ = Annotated[int, Query(ge=0, lt=1 << 62, description="where in the file to start")]
LengthQ = Annotated[int | None, Query(ge=0, le=MAX_FILE_BYTES, description="bytes at most (default: to the end)")]


@dataclass(eq=False)  # one per server: compared and hashed as itself (keys of per-server state)
class ServerContext:
    config: Config
    token: str
    limits: Limits = field(default_factory=Limits)
    default_ttl: float | None = None  # the lease of workspaces made without one
    # E2B's sandbox domain (``<port>-<sandbox id>.<domain>``); None: ``localhost:<port called>``
    e2b_domain: str | None = None
    # the most network a caller may ask for (``serve --network``) and what it gets when it
    # does not say (``serve --network-default``)
    network: NetworkMode = NetworkMode.NONE
    network_default: NetworkMode = NetworkMode.NONE
    locks: WorkspaceLocks = field(default_factory=workspace_locks)  # shared with the groups' caches
    threads: int = THREADS  # the thread pool (``serve --threads``)
    sandbox_threads: int = SANDBOX_THREADS  # of them, one sandbox's data plane at once
    admission: Admission = field(init=False)
    idempotency: Idempotency = field(init=False)
    leases: Leases = field(init=False)
    snapshot_leases: Leases = field(init=False)  # of snapshots loaded with a ttl
    uploads: Uploads = field(init=False)  # one budget for every upload in flight
    shares: Shares = field(init=False)  # each sandbox's share of the thread pool

    def network_mode(self, asked: NetworkMode | str | None) -> NetworkMode:
        """The network a new workspace gets: ``asked``, else the server's default; within
        the server's ceiling, else InvalidArgument (400)."""
        mode = self.network_default if asked is None else NetworkMode.of(asked)
        if mode == NetworkMode.EGRESS and self.network != NetworkMode.EGRESS:
            raise InvalidArgument("this server gives workspaces no egress (network 'none' only)",
                              hint="create without network 'egress', or start the server with "
                                   "`bunshin serve --network egress`")
        return mode

    def __post_init__(self) -> None:
        if self.network_default == NetworkMode.EGRESS and self.network != NetworkMode.EGRESS:
            raise InvalidArgument("--network-default egress needs --network egress (the ceiling)",
                                  hint="bunshin serve --network egress [--network-default egress]")
        self.admission = Admission(self.config, self.limits)
        self.idempotency = Idempotency(self.config)
        self.leases = Leases(self.config)
        self.snapshot_leases = snapshot_leases(self.config)
        self.uploads = Uploads(self.limits.max_upload)
        if self.threads < 2 or self.sandbox_threads < 1:
            raise InvalidArgument(f"--threads {self.threads}, --sandbox-threads {self.sandbox_threads}: the pool "
                                  "needs 2 threads at least, a sandbox 1", hint="give larger numbers")
        self.shares = Shares(self.threads, self.sandbox_threads)

    def out(self, ws: Workspace | WorkspaceInfo) -> m.WorkspaceOut:
        """A workspace on the wire, with its lease."""
        out = info_out(ws.info() if isinstance(ws, Workspace) else ws)
        lease = self.leases.get(out.id)
        return out if lease is None else out.model_copy(update={"expires_at": lease.expires_at})

    def made(self, request: Request, ws: Sequence[Workspace], ttl: float | None) -> list[m.WorkspaceOut]:
        """Workspaces a route made, kept (:meth:`keep`) and on the wire."""
        self.keep(request, ws, ttl)
        return [self.out(w) for w in ws]

    def keep(self, request: Request, ws: Sequence[Workspace], ttl: float | None) -> None:
        """Workspaces a route made, leased for ``ttl`` seconds (else the server's default
        lease, if any); called in the route's thread. If the caller hung up meanwhile,
        nobody will hear of them: they are removed and :class:`CallerGone` raised (an
        idempotency key is freed, so a retry makes them anew)."""
        if anyio.from_thread.run(request.is_disconnected):
            for w in ws:
                try:
                    w.remove()
                except Exception as e:  # gc's then; the caller is gone either way
                    log.warning("removing %s, made for a caller that hung up, failed: %s", w.id, e)
            raise CallerGone(f"{request.method} {request.url.path}: the caller hung up; removed what it made "
                             f"({', '.join(w.id for w in ws)})")
        ttl = ttl if ttl is not None else self.default_ttl
        if ttl is not None:
            self.leases.grant([w.id for w in ws], ttl)


    def ws_of(self, ws_id: str) -> Workspace:
        return Workspace.get(ws_id, config=self.config)

    def locked(self, ws_id: str, fn: Callable[[Workspace], T]) -> T:
        ws = self.ws_of(ws_id)
        with self.locks.held(ws):
            return fn(ws)


class CallerGone(Exception):
    """A route's caller disconnected before its answer; what the route made is undone."""


def info_out(i: WorkspaceInfo) -> m.WorkspaceOut:
    """What ``bunshin ls`` shows of a workspace, on the wire."""
    return m.WorkspaceOut(id=i.id, name=i.name, image=i.image, state=i.state, pid=i.pid,
                          created_at=i.created_at, parent=i.parent, memory_limit=i.memory_limit,
                          pids_limit=i.pids_limit)


def snapshot_out(s: Snapshot) -> m.SnapshotOut:
    r = s.record
    return m.SnapshotOut(id=s.id, source=r.source, mode=r.mode, created_at=r.created_at, depth=r.depth,
                         pause_ms=r.pause_ms, size_bytes=s.size_bytes)
