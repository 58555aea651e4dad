"""CLI commands of the live fork: fork, snapshot, restore, tree, snapshot-rm.

``bunshin snapshot WS`` captures a workspace; ``bunshin snapshot save SNAP DIR``,
``snapshot load DIR``, ``snapshot rm SNAP...`` and ``snapshot ls`` manage
snapshots (``snapshot-rm`` and ``rm snap-...`` remove them too).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.tree import Tree

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..workspace import Snapshot, Workspace
from ..workspace.family import SnapshotNode, WorkspaceNode, build

_SNAPSHOT_VERBS = {"save": 2, "load": 1, "rm": None, "ls": 0}
_SNAPSHOT_USAGE = (
    "bunshin snapshot WS [--json] | snapshot save SNAP DIR | snapshot load DIR [--trust] [--json]"
    " | snapshot rm SNAP... | snapshot ls [--json]"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fork", help="clone a running workspace N ways (live, copy-on-write)")
    p.add_argument("workspace")
    p.add_argument("-n", type=int, default=1, help="number of clones (default 1)")
    p.add_argument("--mode", default="cow", help="cow (default: shared pages) or copy (plain CRIU restore)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fork)

    p = sub.add_parser("snapshot", help="capture a running workspace (prints the snapshot id); "
                                        "also: snapshot save|load|rm|ls", usage=_SNAPSHOT_USAGE)
    p.add_argument("args", nargs="+", metavar="WS | VERB ARGS")
    p.add_argument("--mode", default="cow", help="cow (default) or copy")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trust", action="store_true",
                   help="snapshot load: accept a folder this home did not save (it is still checked)")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("restore", help="start N workspaces from a snapshot")
    p.add_argument("snapshot")
    p.add_argument("-n", type=int, default=1, help="number of workspaces (default 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("tree", help="workspaces and snapshots: who was forked from whom")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-stats", action="store_true", help="skip per-workspace memory (faster)")
    p.set_defaults(func=cmd_tree)

    p = sub.add_parser("snapshot-rm", help="remove snapshots (files go once no workspace uses them)")
    p.add_argument("snapshots", nargs="+")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_rm)


def _clones(clones: list[Workspace]) -> list[dict[str, Any]]:
    return [{"id": c.id, "restore_ms": c.record.extra.get("restore_ms")} for c in clones]


def cmd_fork(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    clones = ws.fork(args.n, mode=args.mode)
    snap = ws.last_fork
    assert snap is not None
    rows = _clones(clones)
    result = {"parent": ws.id, "snapshot": snap.id, "mode": snap.mode, "pause_ms": round(snap.pause_ms, 2),
              "dump_ms": round(snap.dump_ms, 2), "rewrite_ms": round(snap.rewrite_ms, 2),
              "memfile_bytes": snap.memfile_bytes, "clones": rows}
    if args.json:
        output.print_json(result)
    else:
        output.out.print(f"fork of {ws.id} ({snap.mode}, snapshot {snap.id}): parent paused {snap.pause_ms:.0f} ms, "
                         f"dump {snap.dump_ms:.0f} ms, rewrite {snap.rewrite_ms:.0f} ms")
        output.print_table(None, ["CLONE", "RESTORE MS"], [(c["id"], c["restore_ms"]) for c in rows])
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    """``snapshot WS`` captures; ``snapshot VERB ...`` manages (a workspace named like a verb: use its id)."""
    verb, rest = args.args[0], args.args[1:]
    if verb not in _SNAPSHOT_VERBS and not rest:
        return _capture(verb, args.mode, args.json)
    want = _SNAPSHOT_VERBS.get(verb, -1)
    if want == -1 or (want is not None and len(rest) != want) or (want is None and not rest):
        raise InvalidArgument(f"bad snapshot command: {' '.join(args.args)}", hint=_SNAPSHOT_USAGE)
    if verb == "save":
        folder = Snapshot.get(rest[0]).save(rest[1])
        print(folder)
    elif verb == "load":
        snap = Snapshot.load(rest[0], trust=args.trust)
        if args.json:
            output.print_json({"id": snap.id, "source": snap.record.source})
        else:
            print(snap.id)
    elif verb == "rm":
        return _remove(rest, args.json)
    else:
        _list(args.json)
    return 0


def _capture(ref: str, mode: str, as_json: bool) -> int:
    snap = Workspace.get(ref).snapshot(mode=mode).record
    if as_json:
        output.print_json({"id": snap.id, "source": snap.source, "mode": snap.mode, "pause_ms": snap.pause_ms,
                           "dump_ms": snap.dump_ms, "rewrite_ms": snap.rewrite_ms,
                           "memfile_bytes": snap.memfile_bytes})
    else:
        print(snap.id)
    return 0


def _list(as_json: bool) -> None:
    snaps = [s.record for s in Snapshot.list()]
    if as_json:
        output.print_json(snaps)
        return
    output.print_table(None, ["ID", "SOURCE", "MODE", "KEEP", "DEPTH", "MEMORY FILES", "IMAGES", "LAYER"], [
        (s.id, s.source, s.mode, s.keep, s.depth, output.human_bytes(s.memfile_bytes),
         output.human_bytes(s.image_bytes), output.human_bytes(s.layer_bytes)) for s in snaps])


def cmd_restore(args: argparse.Namespace) -> int:
    snap = Snapshot.get(args.snapshot)
    clones = snap.restore(args.n)
    if args.json:
        output.print_json({"snapshot": snap.id, "clones": _clones(clones)})
    else:
        print("\n".join(c.id for c in clones))
    return 0


def cmd_snapshot_rm(args: argparse.Namespace) -> int:
    return _remove(args.snapshots, args.json)


def _remove(refs: list[str], as_json: bool) -> int:
    removed, failed = [], []
    for ref in refs:
        try:
            Snapshot.get(ref).remove()
            removed.append(ref)
        except Exception as e:  # keep going, report the rest
            failed.append(ref)
            output.print_error(e)
    if as_json:
        output.print_json({"removed": removed, "failed": failed})
    elif removed:
        print("\n".join(removed))
    return 1 if failed else 0


def cmd_tree(args: argparse.Namespace) -> int:
    roots = build(Config.from_env(), with_stats=not args.no_stats)
    if args.json:
        output.print_json({"roots": roots})
        return 0
    tree = Tree("[bold]bunshin[/] workspaces and snapshots")
    for node in roots:
        _add(tree, node)
    output.out.print(tree)
    return 0


def _add(parent: Tree, node: WorkspaceNode | SnapshotNode) -> None:
    hb = output.human_bytes
    if isinstance(node, WorkspaceNode):
        bits = [f"[bold cyan]{node.id}[/]" + (f" ({node.name})" if node.name else ""), node.state,
                f"depth {node.depth}"]
        if node.restore_ms is not None:
            bits.append(f"restored in {node.restore_ms:.0f} ms")
        if node.memory is not None:
            bits.append(f"{node.processes} procs, anon {hb(node.memory.anon_bytes)}, "
                        f"cgroup {hb(node.memory.cgroup_bytes)}")
        branch = parent.add(" · ".join(bits))
    else:
        kind = "kept snapshot" if node.keep else "fork"
        bits = [f"[bold magenta]{node.id}[/]", f"{kind} ({node.mode})", f"depth {node.depth}",
                f"paused {node.pause_ms:.0f} ms", f"memory files {hb(node.memfile_bytes)}",
                f"images {hb(node.image_bytes)}", f"layer {hb(node.layer_bytes)}"]
        branch = parent.add(" · ".join(bits))
    for child in node.children:
        _add(branch, child)
