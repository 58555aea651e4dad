"""Saving and loading prefix trees: calls, observations, traffic counts, snapshots.

``DIR/tree.json`` holds the trees and names snapshots by id; with ``snapshots``
each snapshot (the roots too) is also written to ``DIR/snapshots/ID/`` with
``Snapshot.save``. ``load`` takes a snapshot from bunshin's store when it is
still there, else from its folder (``Snapshot.load`` keeps the id), and drops a
node's snapshot that is in neither (the node then materialises from a snapshot
higher up).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..config import Config
from ..errors import BunshinError, InvalidArgument, NotFound
from ..speculate import Predictor
from ..tools import Observation, ToolCall
from ..workspace.aio import AsyncSnapshot
from ..workspace.protocol import SnapshotAPI
from .tree import Node, Tree

log = logging.getLogger("bunshin.cache")
FORMAT = "bunshin-prefix-cache"
VERSION = 1
FILE = "tree.json"
SNAPSHOTS = "snapshots"

Resolve = Callable[[str], SnapshotAPI]
"""A snapshot id -> the snapshot (``NotFound`` if there is none)."""


@runtime_checkable
class Savable(Protocol):
    """A snapshot that can be written to a folder (the local ``Snapshot``)."""

    def save(self, folder: Path) -> object: ...


def store_resolver(config: Config | None, directory: Path, *, trust: bool = False) -> Resolve:
    def resolve(snap_id: str) -> SnapshotAPI:
        from ..workspace import Snapshot

        cfg = config or Config.from_env()
        try:
            return Snapshot.get(snap_id, config=cfg)
        except NotFound:
            folder = directory / SNAPSHOTS / snap_id
            if not folder.is_dir():
                raise
            return Snapshot.load(folder, config=cfg, trust=trust)  # signed by this home unless trusted

    return resolve


def _node_dict(node: Node) -> dict[str, Any]:
    taken_now, taken_before = node.taken()
    return {
        "call": None if node.call is None else {"name": node.call.name, "args": node.call.arguments,
                                                "key": node.call.key},
        "read_only": node.read_only,
        "obs": None if node.obs is None else node.obs.to_dict(),
        "speculated": node.speculated,
        "snapshot": None if node.snapshot is None or node.parent is None else node.snapshot.id,
        "snapshot_bytes": node.snapshot_bytes,
        "snapshot_uses": node.snapshot_uses,
        "reached": node.reached,
        "taken": taken_now + taken_before,
        "children": [_node_dict(c) for c in node.children.values() if c.obs is not None],
    }


def save(trees: Iterable[Tree], directory: Path, *, snapshots: bool) -> Path:
    trees = list(trees)
    directory.mkdir(parents=True, exist_ok=True)
    if snapshots:
        for tree in trees:
            for node in tree.nodes():
                snap = node.snapshot.sync if node.snapshot is not None else None
                if not isinstance(snap, Savable):
                    continue
                folder = directory / SNAPSHOTS / snap.id
                if not (folder / "snapshot.json").is_file():
                    shutil.rmtree(folder, ignore_errors=True)  # a save cut short
                    snap.save(folder)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "trees": [
            {"key": t.key, "root_snapshot": t.root.snapshot.id if t.root.snapshot is not None else None,
             "root": _node_dict(t.root)}
            for t in trees
        ],
    }
    path = directory / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def _lookup(resolve: Resolve, snap_id: str | None) -> AsyncSnapshot | None:
    if snap_id is None:
        return None
    try:
        return AsyncSnapshot(resolve(snap_id))
    except NotFound:
        return None
    except BunshinError as exc:
        log.warning("snapshot %s could not be loaded, its node will replay instead: %s", snap_id, exc)
        return None


def _load_node(tree: Tree, parent: Node | None, d: dict[str, Any], resolve: Resolve,
               predictor: Predictor | None) -> Node:
    c = d["call"]
    call = None if c is None else ToolCall(c["name"], c["args"], key=c["key"])
    node = tree.root if parent is None else Node(tree, parent, call, bool(d["read_only"]))
    if parent is not None:
        assert call is not None
        node.obs = Observation.from_dict(d["obs"])
        node.speculated = bool(d.get("speculated"))
        node.snapshot = _lookup(resolve, d.get("snapshot"))
        node.snapshot_bytes = int(d.get("snapshot_bytes", 0)) if node.snapshot is not None else 0
        parent.children[call.key] = node
    node.snapshot_uses = int(d.get("snapshot_uses", 0))
    node.reached = int(d.get("reached", 0))
    node.taken_before = int(d.get("taken", 0))
    if predictor is not None and call is not None and node.obs is not None:
        prev = parent.call if parent is not None else None
        predictor.observe(prev, call, node.obs.duration_s, weight=max(node.taken_before, 1), earlier=True)
    for child in d.get("children", []):
        _load_node(tree, node, child, resolve, predictor)
    return node


def load(directory: Path, resolve: Resolve, predictor: Predictor | None = None) -> list[Tree]:
    """The trees saved in ``directory``; the ``predictor`` (if any) learns their calls."""
    path = directory / FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"no saved cache in {directory}", hint=f"expected {path}") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise InvalidArgument(f"{path} is not a bunshin prefix cache (version {VERSION})")
    trees = []
    for t in doc["trees"]:
        tree = Tree(t["key"], _lookup(resolve, t.get("root_snapshot")))
        _load_node(tree, None, t["root"], resolve, predictor)
        trees.append(tree)
    return trees
