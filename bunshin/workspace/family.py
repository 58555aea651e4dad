"""The family of workspaces and snapshots: who was snapshotted or forked from whom.

A snapshot hangs under the workspace it was taken from (once that is gone, under
the snapshot whose layer it stacks on); a restored (forked) workspace hangs under
its snapshot. Roots are fresh workspaces and snapshots of neither kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Config
from ..runtime import snapshot as rsnap
from ..runtime.container import lifecycle as container
from ..runtime.container import stats as rstats
from ..runtime.container.stats import MemoryStats
from ..runtime.state.records import WorkspaceRecord, WorkspaceState
from ..runtime.state.store import Store


@dataclass(frozen=True)
class SnapshotNode:
    id: str
    source: str  # the workspace it was taken from (may be gone)
    mode: str
    keep: bool  # explicit snapshot (kept until removed) rather than a fork's
    depth: int
    pause_ms: float
    memfile_bytes: int  # data in the memory files it wrote (shared by its clones)
    image_bytes: int
    layer_bytes: int
    children: list[WorkspaceNode | SnapshotNode] = field(default_factory=list)  # clones; snapshots stacking on it
    kind: str = "snapshot"


@dataclass(frozen=True)
class WorkspaceNode:
    id: str
    name: str | None
    state: str
    depth: int  # 0 for a fresh workspace, its snapshot's depth for a clone
    snapshot: str | None
    restore_ms: float | None
    processes: int | None
    memory: MemoryStats | None  # None when its processes are gone
    children: list[SnapshotNode] = field(default_factory=list)
    kind: str = "workspace"


def build(config: Config, *, with_stats: bool = True) -> list[WorkspaceNode | SnapshotNode]:
    """The family forest, oldest roots first."""
    with Store.open(config.db_path) as store:
        recs = [r for r in store.list_workspaces() if not r.extra.get(rsnap.MADE_AHEAD)]  # made ahead: not yet
        snaps = sorted(rsnap.list_all(store), key=lambda s: s.created_at)
    depth_of = {s.id: s.depth for s in snaps}
    wnodes = {r.id: _workspace_node(r, depth_of, with_stats) for r in recs}
    snodes = {
        s.id: SnapshotNode(s.id, s.source, s.mode, s.keep, s.depth, s.pause_ms, s.memfile_bytes,
                           s.image_bytes, s.layer_bytes)
        for s in snaps
    }
    roots: list[WorkspaceNode | SnapshotNode] = []
    for r in recs:
        parent = snodes.get(r.snapshot) if r.snapshot else None
        (parent.children if parent else roots).append(wnodes[r.id])
    by_layer = {s.layer: snodes[s.id] for s in snaps}
    for s in snaps:
        # under its workspace; once that is gone, under the snapshot it stacks on
        owner = wnodes.get(s.source) or (by_layer.get(s.lowers[0]) if s.lowers else None)
        (owner.children if owner else roots).append(snodes[s.id])
    return roots


def _workspace_node(rec: WorkspaceRecord, depth_of: dict[str, int], with_stats: bool) -> WorkspaceNode:
    state = rec.state
    alive = state == WorkspaceState.RUNNING and container.is_alive(rec)
    if state == WorkspaceState.RUNNING and not alive:
        state = WorkspaceState.DEAD
    memory, processes = None, None
    if with_stats and alive:
        try:
            st = rstats.collect(rec)
            memory, processes = st.memory, st.processes
        except OSError:
            pass
    return WorkspaceNode(
        rec.id, rec.name, state.value, depth_of.get(rec.snapshot or "", 0), rec.snapshot,
        rec.extra.get("restore_ms"), processes, memory,
    )
