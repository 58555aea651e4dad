"""What E2B knows of a sandbox that a workspace does not: its template, metadata, env vars,
and, once paused, the snapshot it resumes from.

An E2B sandbox id is the workspace id, verbatim. A running sandbox is a live workspace
(any of the server's, also those made by bunshin's own API: they show with their image as
template); a paused one is a record (the store's ``objects`` of kind ``e2b-sandbox``, so a
restarted server keeps it) whose workspace is gone and whose snapshot brings it back under
the same id. Records are written before the answer goes out and dropped with the sandbox.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import psutil

from ...config import Config
from ...errors import NotFound
from ...runtime.container.lifecycle import ID_RE
from ...runtime.state.records import WorkspaceState
from ...runtime.state.store import Store
from ...workspace import Workspace, WorkspaceInfo
from .keylocks import KeyLocks

KIND = "e2b-sandbox"
#: How long a sandbox made without a timeout lives (the SDK's default too).
DEFAULT_TIMEOUT_S = 300

State = Literal["running", "paused"]


@dataclass(frozen=True)
class SandboxRecord:
    """One sandbox's E2B side. ``timeout``: its lease in seconds (given again on resume);
    ``snapshot``: what a paused one resumes from."""

    id: str
    template_id: str
    started_at: float
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    allow_internet_access: bool | None = None
    state: State = "running"
    snapshot: str | None = None
    paused_at: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SandboxRecord:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Sandbox:
    """A sandbox as E2B shows it: its record (one is made up for a workspace without one)
    and, when running, its workspace."""

    record: SandboxRecord
    info: WorkspaceInfo | None

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> State:
        return "running" if self.info is not None else "paused"


def valid_id(sandbox_id: str) -> bool:
    """A sandbox id is a workspace id, exactly (no prefix, no name)."""
    return ID_RE.fullmatch(sandbox_id) is not None


class Sandboxes:
    """The sandboxes of one server: records in the store, and one lock per sandbox held by
    whatever changes its state (pause, resume, kill), so two resumes make one workspace."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._locks = KeyLocks()

    def held(self, sandbox_id: str) -> AbstractContextManager[None]:
        """The sandbox's lock, held (kept only while some caller holds or awaits it)."""
        return self._locks.held(sandbox_id)

    # records -----------------------------------------------------------------------

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        with Store.open(self._config.db_path) as store:
            raw = store.get_object(KIND, sandbox_id)
        return SandboxRecord.from_json(raw) if raw is not None else None

    def put(self, *recs: SandboxRecord) -> None:
        with Store.open(self._config.db_path) as store, store.transaction():
            for rec in recs:
                store.put_object(KIND, rec.id, rec.to_json())

    def drop(self, sandbox_id: str) -> None:
        with Store.open(self._config.db_path) as store:
            store.delete_object(KIND, sandbox_id)

    def records(self) -> dict[str, SandboxRecord]:
        with Store.open(self._config.db_path) as store:
            return {i: SandboxRecord.from_json(raw) for i, raw in store.list_objects(KIND)}

    # sandboxes ---------------------------------------------------------------------

    def get(self, sandbox_id: str) -> Sandbox:
        """The sandbox, running or paused; :class:`NotFound` if there is none by that id.
        A record whose workspace went without it (a lease ran out, ``DELETE /v1/...``) is
        dropped here."""
        if not valid_id(sandbox_id):
            raise NotFound(f"sandbox {sandbox_id[:80]!r} not found", hint="a sandbox id looks like ws-0123456789ab")
        rec = self.record(sandbox_id)
        if rec is not None and rec.state == "paused":
            return Sandbox(rec, None)
        try:
            info = Workspace.get(sandbox_id, config=self._config).info()
        except NotFound:
            info = None
        if info is None or info.id != sandbox_id or info.state == WorkspaceState.DEAD.value:
            if rec is not None:
                self.drop(sandbox_id)
            raise NotFound(f"sandbox {sandbox_id} not found", hint="it was killed, or its timeout ran out")
        return Sandbox(rec or _made_up(info), info)

    def all(self) -> list[Sandbox]:
        """Every sandbox: the live workspaces and the paused records."""
        recs = self.records()
        live = {i.id: i for i in Workspace.list(config=self._config) if i.state != WorkspaceState.DEAD.value}
        out = [Sandbox(recs.get(i.id) or _made_up(i), i) for i in live.values()]
        out += [Sandbox(r, None) for r in recs.values() if r.state == "paused"]
        for gone in [r.id for r in recs.values() if r.state == "running" and r.id not in live]:
            self.drop(gone)  # its workspace went without it (a lease ran out, bunshin's own DELETE)
        return out

    def paused(self, sb: Sandbox, snapshot: str) -> SandboxRecord:
        rec = replace(sb.record, state="paused", snapshot=snapshot, paused_at=time.time())
        self.put(rec)
        return rec

    def resumed(self, rec: SandboxRecord, timeout: int | None) -> SandboxRecord:
        rec = replace(rec, state="running", snapshot=None, paused_at=None, started_at=time.time(),
                      timeout=timeout if timeout is not None else rec.timeout)
        self.put(rec)
        return rec


def _made_up(info: WorkspaceInfo) -> SandboxRecord:
    """The record of a workspace E2B's API did not make: its image is its template."""
    return SandboxRecord(id=info.id, template_id=info.image, started_at=info.created_at)


def sandbox_envs(config: Config, sandbox_id: str) -> dict[str, str]:
    """The env vars a sandbox was created with (``envVars``): every process envd starts in
    it has them (its own ``envs`` win)."""
    with Store.open(config.db_path) as store:
        raw = store.get_object(KIND, sandbox_id)
    return SandboxRecord.from_json(raw).envs if raw is not None else {}


def metadata_matches(rec: SandboxRecord, wanted: dict[str, str]) -> bool:
    return all(rec.metadata.get(k) == v for k, v in wanted.items())


def resources(memory_limit: int | None) -> dict[str, Any]:
    """``cpuCount``, ``memoryMB`` and ``diskSizeMB`` of a sandbox: the host's CPUs (workspaces
    share them), its memory limit (else the host's memory), its upper's size (half the memory
    limit: a workspace's files are memory)."""
    mem = memory_limit or psutil.virtual_memory().total
    return {"cpuCount": os.cpu_count() or 1, "memoryMB": mem >> 20, "diskSizeMB": max(mem // 2, 16 << 20) >> 20}
