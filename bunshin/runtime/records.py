"""Typed records of what the runtime created, and the allowed state transitions."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateConflict


class WorkspaceState(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    DEAD = "dead"  # its processes are gone (killed, crashed, host rebooted)
    REMOVING = "removing"


# The one place where transitions are written down.
TRANSITIONS: dict[WorkspaceState, frozenset[WorkspaceState]] = {
    WorkspaceState.CREATING: frozenset({WorkspaceState.RUNNING, WorkspaceState.REMOVING, WorkspaceState.DEAD}),
    WorkspaceState.RUNNING: frozenset({WorkspaceState.DEAD, WorkspaceState.REMOVING}),
    WorkspaceState.DEAD: frozenset({WorkspaceState.REMOVING}),
    WorkspaceState.REMOVING: frozenset(),
}


def check_transition(ws_id: str, old: WorkspaceState, new: WorkspaceState) -> None:
    if new not in TRANSITIONS[old]:
        raise StateConflict(f"workspace {ws_id} cannot go from {old.value} to {new.value}")


@dataclass(frozen=True)
class WorkspaceRecord:
    """Everything needed to find, use and tear down one workspace."""

    id: str
    name: str | None
    image: str
    state: WorkspaceState
    created_at: float
    root: str  # the overlay mount point on the host
    upper: str
    work: str
    lowers: tuple[str, ...]  # top first, as overlayfs takes them
    cgroup_version: int
    cgroups: tuple[tuple[str, str], ...]  # (controller, folder)
    memory_limit: int | None
    pids_limit: int | None
    hostname: str
    pid: int | None = None  # host pid of the workspace's pid 1
    pid_start: float | None = None  # its start time, against pid reuse
    owner_pid: int | None = None  # the process creating it, while CREATING
    command: tuple[str, ...] | None = None
    parent: str | None = None  # the workspace it was forked from
    snapshot: str | None = None  # the snapshot it was restored from
    extra: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> WorkspaceRecord:
        if "state" in changes and changes["state"] != self.state:
            check_transition(self.id, self.state, changes["state"])
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["state"] = self.state.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> WorkspaceRecord:
        d = json.loads(text)
        d["state"] = WorkspaceState(d["state"])
        d["lowers"] = tuple(d["lowers"])
        d["cgroups"] = tuple(tuple(c) for c in d["cgroups"])
        if d.get("command") is not None:
            d["command"] = tuple(d["command"])
        return cls(**d)
