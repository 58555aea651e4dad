"""A snapshot's record and what keeps it alive.

The record (``SnapshotRecord``, kind ``KIND`` in the store), reading and updating it, and
its lifetime: a snapshot taken by ``fork`` lives while any workspace stacks on its
layer; one taken explicitly (``keep``) lives until removed. While a process is still
taking, forking or loading one (``claim``, ``owner_pid``), nothing frees it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ...config import Config
from ...errors import (
    SnapshotNotFound,
)
from ..state.records import Mount, SnapshotMode, mounts_from_json, record_json
from ..state.store import Store

KIND = "snapshot"
MEM_VIEW = "/.bunshin/mem"
MODES = tuple(SnapshotMode)  # the values a caller may give, "cow" first


@dataclass(frozen=True)
class SnapshotRecord:
    """A dumped workspace: images, frozen layer, memory files."""

    id: str
    source: str
    image: str
    mode: SnapshotMode
    keep: bool
    created_at: float
    images: str
    layer: str
    lowers: tuple[str, ...]  # below ``layer``, top first
    memfiles: tuple[str, ...]  # host paths of the memory files this snapshot wrote
    memory_limit: int | None
    pids_limit: int | None
    hostname: str
    depth: int  # 1 for a snapshot of a fresh workspace, +1 per generation
    dump_ms: float
    pause_ms: float
    rewrite_ms: float
    memfile_bytes: int
    image_bytes: int
    layer_bytes: int
    owner_pid: int | None = None  # the process taking, forking or loading it; sweep leaves it alone
    mounts: tuple[Mount, ...] = ()  # the source's shared host folders, for its clones
    network: str = "none"  # the source's network mode, for its clones (``runtime.net``)
    net_policy: dict[str, Any] | None = None  # its egress policy at the dump (``Policy.to_dict``)

    def to_json(self) -> str:
        return record_json(self)

    @classmethod
    def from_json(cls, text: str) -> SnapshotRecord:
        d = json.loads(text)
        d["lowers"], d["memfiles"] = tuple(d["lowers"]), tuple(d["memfiles"])
        d["mode"] = SnapshotMode(d["mode"])
        d["mounts"] = mounts_from_json(d.get("mounts", []))
        return cls(**d)


def get(store: Store, snap_id: str) -> SnapshotRecord:
    data = store.get_object(KIND, snap_id)
    if data is None:
        matches = [d for i, d in store.list_objects(KIND) if i.startswith(snap_id)]
        if len(matches) != 1:
            raise SnapshotNotFound(f"no snapshot {snap_id!r}", hint="`bunshin tree` lists snapshots")
        data = matches[0]
    return SnapshotRecord.from_json(data)


def kept_bytes(store: Store) -> int:
    """What the kept snapshots hold on bunshin's tmpfs: memory files, images and layer (read in SQL)."""
    return store.sum_objects(KIND, ("memfile_bytes", "image_bytes", "layer_bytes"), where="keep")


def list_all(store: Store) -> list[SnapshotRecord]:
    return [SnapshotRecord.from_json(d) for _, d in store.list_objects(KIND)]


def update(store: Store, snap_id: str, **changes: Any) -> SnapshotRecord | None:
    """Change fields of the stored record ``snap_id`` (read and written back in one
    transaction: a concurrent change to another field is kept); None if it is gone."""
    data = store.update_object(KIND, snap_id, lambda d: dataclasses.replace(SnapshotRecord.from_json(d), **changes).to_json())
    return None if data is None else SnapshotRecord.from_json(data)


def finish(store: Store, snap: SnapshotRecord, **changes: Any) -> SnapshotRecord:
    """``update`` the record this process wrote for ``snap``; if it went meanwhile, write
    ``snap`` with the changes again."""
    done = update(store, snap.id, **changes)
    if done is None:
        done = dataclasses.replace(snap, **changes)
        store.put_object(KIND, snap.id, done.to_json())
    return done


def mem_dir(cfg: Config) -> Path:
    return cfg.paths.mem


def release(store: Store, snap: SnapshotRecord) -> SnapshotRecord:
    """Clear the snapshot's owner: from now on ``sweep`` may free it when nothing holds it."""
    unclaim(snap.id)
    return update(store, snap.id, owner_pid=None) or snap


#: Snapshots this process is taking, forking from or loading right now, with how many of
#: its threads do (two may load the same one). One it owns (``owner_pid``) but no longer
#: makes, after a path that missed ``release``, is not held by it.
_MAKING: collections.Counter[str] = collections.Counter()
_MAKING_LOCK = threading.Lock()


def claim(snap_id: str) -> None:
    """This thread makes ``snap_id`` from now on (call before writing its record)."""
    with _MAKING_LOCK:
        _MAKING[snap_id] += 1


def unclaim(snap_id: str) -> None:
    """This thread no longer makes ``snap_id`` (done, released or failed)."""
    with _MAKING_LOCK:
        _MAKING[snap_id] -= 1
        if _MAKING[snap_id] <= 0:
            del _MAKING[snap_id]


def _owner_alive(snap: SnapshotRecord) -> bool:
    if snap.owner_pid == os.getpid():
        with _MAKING_LOCK:
            return _MAKING[snap.id] > 0
    return snap.owner_pid is not None and psutil.pid_exists(snap.owner_pid)


def _retained(snap: SnapshotRecord) -> bool:
    """Kept explicitly (and complete), or still being made by a live process."""
    return _owner_alive(snap) or (snap.keep and snap.owner_pid is None)


def held_layers(store: Store) -> set[str]:
    """Layers some workspace or retained snapshot stacks on."""
    held: set[str] = set()
    for rec in store.list_workspaces():
        held.update(rec.lowers)
    for s in list_all(store):
        if _retained(s):
            held.update((s.layer, *s.lowers))
    return held
