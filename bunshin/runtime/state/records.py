"""Typed records of what the runtime created, and the allowed state transitions."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgument, StateConflict


class SnapshotMode(enum.StrEnum):
    """How a snapshot keeps memory: ``cow`` shares it copy-on-write with its clones
    (memory files on tmpfs), ``copy`` is a plain CRIU restore with private pages."""

    COW = "cow"
    COPY = "copy"


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


# Where a shared host folder may not go: what the runtime mounts or writes inside.
_RESERVED = ("/proc", "/sys", "/dev", "/.bunshin", "/run/bunshin")
_MOUNT_HINT = "give --mount HOST:PATH[:ro|rw] with absolute paths, e.g. --mount /data/set:/data:ro"


@dataclass(frozen=True)
class Mount:
    """A host folder shared on purpose at ``path`` inside (``--mount HOST:PATH[:ro|rw]``).

    Read-only (the default): an idmapped view, the folder's files owned inside as on the
    host. Read-write: a plain bind, so what the workspace creates there is owned by host
    uid ``Config.id_base`` (never host root: nothing setuid-root can be planted) and the
    host's own files show as nobody inside (writable only where the host's modes let
    that uid write). Clones of the workspace share the same folder.
    """

    host: str
    path: str
    read_only: bool = True

    @classmethod
    def parse(cls, text: str) -> Mount:
        """``HOST:PATH[:ro|rw]``, checked (``check``)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"mount {text!r} is not a string", hint=_MOUNT_HINT)
        parts = text.split(":")
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            return cls(parts[0], parts[1], parts[2] == "ro").check()
        if len(parts) == 2:
            return cls(parts[0], parts[1]).check()
        raise InvalidArgument(f"mount {text!r} is not HOST:PATH[:ro|rw]", hint=_MOUNT_HINT)

    @classmethod
    def of(cls, value: Mount | str | dict[str, Any]) -> Mount:
        """A mount from its string form, a ``{"host", "path", "read_only"}`` mapping or itself, checked."""
        if isinstance(value, Mount):
            return value.check()
        if isinstance(value, dict):
            if set(value) - {"host", "path", "read_only"} or not {"host", "path"} <= set(value) \
                    or not isinstance(value.get("read_only", True), bool):
                raise InvalidArgument(f"mount {value!r} needs host, path and an optional read_only (true/false)",
                                      hint=_MOUNT_HINT)
            return cls(value["host"], value["path"], value.get("read_only", True)).check()
        return cls.parse(value)

    def check(self) -> Mount:
        """This mount with HOST resolved (a real folder now) and PATH checked; or ``InvalidArgument``."""
        host, path = self.host, self.path
        if not isinstance(host, str) or not host.startswith("/") or "\0" in host:
            raise InvalidArgument(f"mount host folder {host!r} is not an absolute path", hint=_MOUNT_HINT)
        if not os.path.isdir(host):
            raise InvalidArgument(f"mount host folder {host} does not exist or is not a folder",
                                  hint="create it first; only a folder can be shared")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            raise InvalidArgument(f"mount path {path!r} is not an absolute path without '..'", hint=_MOUNT_HINT)
        if os.path.normpath(path) != path or path.startswith("//"):
            raise InvalidArgument(f"mount path {path!r} is not normalised",
                                  hint=f"write it as {os.path.normpath(path)!r}")
        if path == "/" or any(_within(path, r) or _within(r, path) for r in _RESERVED):
            raise InvalidArgument(f"mount path {path} is or holds a folder the runtime makes",
                                  hint="not /, nor in or above " + ", ".join(_RESERVED))
        return Mount(os.path.realpath(host), path, bool(self.read_only))

    def __str__(self) -> str:
        return f"{self.host}:{self.path}:{'ro' if self.read_only else 'rw'}"


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_mounts(mounts: Iterable[Mount | str | dict[str, Any]]) -> tuple[Mount, ...]:
    """Checked mounts; no PATH in or above another's (a mount point would be made in a host folder)."""
    out = tuple(Mount.of(m) for m in mounts)
    for i, a in enumerate(out):
        for b in out[i + 1:]:
            if _within(a.path, b.path) or _within(b.path, a.path):
                raise InvalidArgument(f"mounts {a} and {b} overlap inside", hint="give each a separate PATH")
    return out


#: In the ``extra`` of a workspace record made ahead of its restore (``runtime.snapshot.ahead``)
#: until the restore: lists of workspaces and the server's caps leave it out.
MADE_AHEAD = "made_ahead"


def record_json(rec: Any, **values: Any) -> str:
    """A frozen record's JSON: its fields one level deep (``json.dumps`` walks the tuples,
    lists and dicts in them; ``dataclasses.asdict`` deep-copies each first: 0.13 ms of a
    workspace record's 0.16), ``values`` in place of those fields, ``mounts`` as mappings."""
    d = {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}
    if "mounts" in d:
        d["mounts"] = [{"host": m.host, "path": m.path, "read_only": m.read_only} for m in d["mounts"]]
    d.update(values)
    return json.dumps(d)


def mounts_from_json(value: Any) -> tuple[Mount, ...]:
    """Mounts as records store them (not re-checked against the host)."""
    if not isinstance(value, list | tuple):
        raise TypeError(f"mounts must be a list, not {type(value).__name__}")
    out = []
    for m in value:
        if not isinstance(m, dict) or set(m) != {"host", "path", "read_only"} or not all(
                isinstance(m[k], str) for k in ("host", "path")) or not isinstance(m["read_only"], bool):
            raise TypeError(f"bad mount {m!r}")
        out.append(Mount(m["host"], m["path"], m["read_only"]))
    return tuple(out)


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
    owner_pid: int | None = None  # the process creating it (a restore: until its whole batch is in)
    command: tuple[str, ...] | None = None
    parent: str | None = None  # the workspace it was forked from
    snapshot: str | None = None  # the snapshot it was restored from
    extra: dict[str, Any] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()  # host folders shared on purpose, in --mount order
    # host uid (and gid) of root inside, the first of the workspace's own range of
    # ``Config.id_count`` ids (``idranges``); None: ``Config.id_base`` (older records)
    ids: int | None = None
    # "none" (loopback only) or "egress" (``runtime.net``: its address, route and policy
    # live with its slot in the store)
    network: str = "none"

    def replace(self, **changes: Any) -> WorkspaceRecord:
        if "state" in changes and changes["state"] != self.state:
            check_transition(self.id, self.state, changes["state"])
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return record_json(self, state=self.state.value)

    @classmethod
    def from_json(cls, text: str) -> WorkspaceRecord:
        d = json.loads(text)
        d["state"] = WorkspaceState(d["state"])
        d["lowers"] = tuple(d["lowers"])
        d["cgroups"] = tuple(tuple(c) for c in d["cgroups"])
        if d.get("command") is not None:
            d["command"] = tuple(d["command"])
        d["mounts"] = mounts_from_json(d.get("mounts", []))
        return cls(**d)
