"""Host id ranges of workspaces: one of its own for each workspace and each clone.

The kernel counts several budgets per host uid, not per container. Pipe buffers
(``fs.pipe-user-pages-soft``) and keys (``kernel.keys.maxkeys``) are charged to the
kuid of the process (its ``user_struct``); inotify instances and watches, POSIX message
queue bytes, pending signals and processes (``ucounts``) are charged at every user
namespace level up to the initial one, where they go to the namespace's *owner* (the
euid that created it). So each workspace gets a range ``[base, base + id_count)`` of
its own: root inside is ``base``, and its user namespace is created by a process whose
euid is ``base`` (``init`` for a new workspace, ``criu.Placement.owner`` for a clone).
One workspace exhausting any of these budgets then leaves every other one, and host
root, untouched.

Files keep one owner range on disk, ``Config.id_base`` (range 0, which no workspace
gets): a workspace sees its layers and upper through idmapped views that map that
range to its own (``idmap``), so a frozen upper, a snapshot layer and a fork of a fork
need no chown.

A range is reserved in the store (kind ``idrange``, id = its index) before anything
uses it, by the workspace it is for, and freed with the workspace (``free``); a
reservation whose workspace and maker are gone is left over from a crash (``sweep``).
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3

import psutil

from ...config import Config
from ...errors import ResourceExhausted
from .store import Store

KIND = "idrange"
_TRIES = 64


def count(cfg: Config) -> int:
    """Ranges a workspace may get: indexes 1..count (0 is the layers' own range)."""
    return max(0, min(cfg.id_ranges, (0xFFFFFFFE - cfg.id_base) // cfg.id_count - 1))


def base(cfg: Config, index: int) -> int:
    """The first host id of range ``index``."""
    return cfg.id_base + index * cfg.id_count


def index_of(cfg: Config, host_base: int) -> int:
    return (host_base - cfg.id_base) // cfg.id_count


def reserve(cfg: Config, store: Store, ws_id: str) -> int:
    """A free range for the workspace ``ws_id``, recorded; its first host id."""
    n = count(cfg)
    for _ in range(_TRIES):
        k = 1 + secrets.randbelow(n)
        data = json.dumps({"workspace": ws_id, "pid": os.getpid()})
        try:
            store.insert_object(KIND, str(k), data)
        except sqlite3.IntegrityError:
            continue
        return base(cfg, k)
    raise ResourceExhausted(f"no free host id range for a workspace (tried {_TRIES} of {n})",
                            hint="remove workspaces, or give Config.id_ranges more ranges")


def free(cfg: Config, store: Store, host_base: int | None) -> None:
    if host_base is not None and host_base != cfg.id_base:
        store.delete_object(KIND, str(index_of(cfg, host_base)))


def held(cfg: Config, store: Store) -> dict[int, str]:
    """Reserved ranges (first host id) and the workspace each is for."""
    return {base(cfg, int(k)): json.loads(d)["workspace"] for k, d in store.list_objects(KIND)}


def sweep(cfg: Config, store: Store) -> list[int]:
    """Free reservations whose workspace has no record and whose maker is gone; their bases."""
    return [base(cfg, int(k)) for k in sweep_reservations(store, KIND)]


def sweep_reservations(store: Store, kind: str) -> list[str]:
    """Delete the records of ``kind`` (each ``{"workspace", "pid", ...}``: a reservation)
    whose workspace has no record and whose maker is gone; their ids."""
    live = {r.id for r in store.list_workspaces()}
    out = []
    for k, data in store.list_objects(kind):
        d = json.loads(data)
        if d["workspace"] in live or psutil.pid_exists(d["pid"]):
            continue
        store.delete_object(kind, k)
        out.append(k)
    return out
