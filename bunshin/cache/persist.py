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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Config
from ..errors import BunshinError, InvalidArgument, NotFound
from ..speculate import Call
from ..tools import Observation
from .tree import Node, Tree

if TYPE_CHECKING:
    from .prefix import PrefixCache

log = logging.getLogger("bunshin.cache")
FORMAT = "bunshin-prefix-cache"
VERSION = 1
FILE = "tree.json"
SNAPSHOTS = "snapshots"


def store_resolver(config: Config | None, directory: Path, *, trust: bool = False) -> Callable[[str], Any]:
    def resolve(snap_id: str) -> Any:
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
        "call": None if node.call is None else {"name": node.call.name, "args": node.call.args, "key": node.call.key},
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


def save(cache: PrefixCache, directory: Path, *, snapshots: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if snapshots:
        for tree in cache._trees.values():
            for node in tree.nodes():
                snap = node.snapshot
                folder = directory / SNAPSHOTS / str(getattr(snap, "id", ""))
                if snap is not None and hasattr(snap, "save") and not (folder / "snapshot.json").is_file():
                    shutil.rmtree(folder, ignore_errors=True)  # a save cut short
                    snap.save(folder)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "trees": [
            {"key": t.key, "root_snapshot": getattr(t.root.snapshot, "id", None), "root": _node_dict(t.root)}
            for t in cache._trees.values()
        ],
    }
    path = directory / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path


def _lookup(resolve: Callable[[str], Any], snap_id: str | None) -> Any:
    if snap_id is None:
        return None
    try:
        return resolve(snap_id)
    except NotFound:
        return None
    except BunshinError as exc:
        log.warning("snapshot %s could not be loaded, its node will replay instead: %s", snap_id, exc)
        return None


def _load_node(tree: Tree, parent: Node | None, d: dict[str, Any], resolve: Callable[[str], Any],
               cache: PrefixCache) -> Node:
    c = d["call"]
    call = None if c is None else Call(c["name"], c["args"], c["key"])
    node = tree.root if parent is None else Node(tree, parent, call, bool(d["read_only"]))
    if parent is not None:
        node.obs = Observation.from_dict(d["obs"])
        node.speculated = bool(d.get("speculated"))
        node.snapshot = _lookup(resolve, d.get("snapshot"))
        node.snapshot_bytes = int(d.get("snapshot_bytes", 0)) if node.snapshot is not None else 0
        parent.children[call.key] = node  # type: ignore[union-attr]
    node.snapshot_uses = int(d.get("snapshot_uses", 0))
    node.reached = int(d.get("reached", 0))
    node.taken_before = int(d.get("taken", 0))
    if cache.speculation is not None and call is not None and node.obs is not None:
        prev = parent.call if parent is not None else None
        cache.speculation.predictor.observe(prev, call, node.obs.duration_s,
                                            weight=max(node.taken_before, 1), earlier=True)
    for child in d.get("children", []):
        _load_node(tree, node, child, resolve, cache)
    return node


def load(cache: PrefixCache, directory: Path, resolve: Callable[[str], Any]) -> None:
    path = directory / FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"no saved cache in {directory}", hint=f"expected {path}") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise InvalidArgument(f"{path} is not a bunshin prefix cache (version {VERSION})")
    for t in doc["trees"]:
        tree = Tree(t["key"], _lookup(resolve, t.get("root_snapshot")))
        _load_node(tree, None, t["root"], resolve, cache)
        cache._trees[tree.key] = tree
