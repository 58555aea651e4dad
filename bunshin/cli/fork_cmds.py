"""CLI commands of the live fork: fork, restore, tree and the ``snapshot`` group.

``bunshin snapshot create WS`` (short: ``snapshot WS``) captures a workspace;
``snapshot save SNAP DIR``, ``snapshot load DIR``, ``snapshot rm SNAP...`` and
``snapshot ls`` manage snapshots. ``snapshot rm`` is the one way to remove one
(``snapshot-rm`` and ``rm snap-...`` still work, with a deprecation note).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.tree import Tree

from .. import console as output
from ..config import Config
from ..workspace import Snapshot, Workspace, WorkspaceInfo
from ..workspace.family import SnapshotNode, WorkspaceNode, build
from . import exits

SNAPSHOT_VERBS = ("create", "save", "load", "rm", "ls")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fork", help="clone a running workspace N ways (live, copy-on-write)")
    p.add_argument("workspace")
    p.add_argument("-n", type=int, default=1, help="number of clones (default 1)")
    p.add_argument("--mode", default="cow", help="cow (default: shared pages) or copy (plain CRIU restore)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_fork)

    register_snapshot(sub)

    p = sub.add_parser("restore", help="start N workspaces from a snapshot")
    p.add_argument("snapshot")
    p.add_argument("-n", type=int, default=1, help="number of workspaces (default 1)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_restore)

    p = sub.add_parser("tree", help="workspaces and snapshots: who was forked from whom")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-stats", action="store_true", help="skip per-workspace memory (faster)")
    p.set_defaults(func=cmd_tree)

    p = sub.add_parser("snapshot-rm")  # no help: hidden, the deprecated spelling of `snapshot rm`
    p.add_argument("snapshots", nargs="+")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_rm_deprecated)


def register_snapshot(sub: argparse._SubParsersAction) -> None:
    """``bunshin snapshot create|save|load|rm|ls``, each with its own help
    (``bunshin snapshot WS`` is short for ``snapshot create WS``)."""
    group = sub.add_parser("snapshot", help="snapshots: create, save, load, rm, ls",
                           description="Capture running workspaces and manage the snapshots. "
                                       "`bunshin snapshot WS` is short for `bunshin snapshot create WS`.")
    ssub = group.add_subparsers(dest="verb", metavar="VERB")
    ssub.required = True
    p = ssub.add_parser("create", help="capture a running workspace (it keeps running); prints the snapshot id")
    p.add_argument("workspace")
    p.add_argument("--mode", default="cow", help="cow (default) or copy")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_create)
    p = ssub.add_parser("save", help="write a snapshot to a folder (to load it on another host or later)")
    p.add_argument("snapshot")
    p.add_argument("folder")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_save)
    p = ssub.add_parser("load", help="bring back a snapshot a `snapshot save` wrote; prints its id")
    p.add_argument("folder")
    p.add_argument("--trust", action="store_true",
                   help="accept a folder this home did not save (it is still checked)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_load)
    p = ssub.add_parser("rm", help="remove snapshots (their files go once no workspace uses them)")
    p.add_argument("snapshots", nargs="+")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_rm)
    p = ssub.add_parser("ls", help="list snapshots")
    p.add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_snapshot_ls)


def forks_json(clones: list[Workspace]) -> list[dict[str, Any]]:
    """The new workspaces as the HTTP API shows them (``WorkspaceOut``), with each one's restore time."""
    return [{**output.to_jsonable(WorkspaceInfo.of(c.record)), "restore_ms": c.record.extra.get("restore_ms")}
            for c in clones]


def cmd_fork(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    with output.progress(f"forking {ws.id} {args.n} ways", quiet=args.json):
        clones = ws.fork(args.n, mode=args.mode)
    snap = ws.last_fork
    assert snap is not None
    rows = forks_json(clones)
    result = {"parent": ws.id, "snapshot": snap.id, "mode": snap.mode, "pause_ms": round(snap.pause_ms, 2),
              "dump_ms": round(snap.dump_ms, 2), "rewrite_ms": round(snap.rewrite_ms, 2),
              "memfile_bytes": snap.memfile_bytes, "forks": rows}
    if args.json:
        output.print_json(result)
    else:
        output.out.print(f"fork of {ws.id} ({snap.mode}, snapshot {snap.id}): parent paused {snap.pause_ms:.0f} ms, "
                         f"dump {snap.dump_ms:.0f} ms, rewrite {snap.rewrite_ms:.0f} ms")
        output.print_table(None, ["CLONE", "RESTORE MS"], [(c["id"], c["restore_ms"]) for c in rows])
    return 0


def cmd_snapshot_create(args: argparse.Namespace) -> int:
    with output.progress(f"snapshot of {args.workspace}", quiet=args.json):
        snap = Workspace.get(args.workspace).snapshot(mode=args.mode)
    if args.json:  # the HTTP API's SnapshotOut, and the dump's times
        r = snap.record
        output.print_json({"id": snap.id, "source": r.source, "mode": r.mode, "created_at": r.created_at,
                           "depth": r.depth, "pause_ms": r.pause_ms, "size_bytes": snap.size_bytes,
                           "dump_ms": r.dump_ms, "rewrite_ms": r.rewrite_ms, "memfile_bytes": r.memfile_bytes})
    else:
        print(snap.id)
    return 0


def cmd_snapshot_save(args: argparse.Namespace) -> int:
    with output.progress(f"saving {args.snapshot} to {args.folder}", quiet=args.json):
        folder = Snapshot.get(args.snapshot).save(args.folder)
    if args.json:
        output.print_json({"id": args.snapshot, "folder": str(folder)})
    else:
        print(folder)
    return 0


def cmd_snapshot_load(args: argparse.Namespace) -> int:
    with output.progress(f"loading {args.folder}", quiet=args.json):
        snap = Snapshot.load(args.folder, trust=args.trust)
    if args.json:
        output.print_json({"id": snap.id, "source": snap.record.source})
    else:
        print(snap.id)
    return 0


def cmd_snapshot_ls(args: argparse.Namespace) -> int:
    listed = Snapshot.list()
    snaps = [s.record for s in listed]
    if args.json:  # each record with the HTTP API's size_bytes
        output.print_json([{**output.to_jsonable(s.record), "size_bytes": s.size_bytes} for s in listed])
    elif args.quiet:
        for s in snaps:
            print(s.id)
    else:
        output.print_table(None, ["ID", "SOURCE", "MODE", "KEEP", "DEPTH", "MEMORY FILES", "IMAGES", "LAYER"], [
            (s.id, s.source, s.mode, s.keep, s.depth, output.human_bytes(s.memfile_bytes),
             output.human_bytes(s.image_bytes), output.human_bytes(s.layer_bytes)) for s in snaps])
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    snap = Snapshot.get(args.snapshot)
    with output.progress(f"restoring {args.n} from {snap.id}", quiet=args.json):
        clones = snap.restore(args.n)
    if args.json:
        output.print_json({"snapshot": snap.id, "forks": forks_json(clones)})
    else:
        print("\n".join(c.id for c in clones))
    return 0


def cmd_snapshot_rm(args: argparse.Namespace) -> int:
    return remove_snapshots(args.snapshots, args.json)


def cmd_snapshot_rm_deprecated(args: argparse.Namespace) -> int:
    output.deprecated("bunshin snapshot-rm", "bunshin snapshot rm")
    return remove_snapshots(args.snapshots, args.json)


def remove_snapshots(refs: list[str], as_json: bool) -> int:
    """``snapshot rm``: each one removed, the failures reported (exit 125 if any)."""
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
    return exits.FAILED if failed else 0


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
