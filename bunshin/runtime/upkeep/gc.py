"""Garbage collection: remove whatever no live recorded workspace owns.

After a crash or a ``kill -9`` of any bunshin process this restores a clean
machine: stale records (creator or workspace dead, or a clone whose fork batch never
committed), orphaned overlay mounts,
cgroups and their processes, workspace folders on tmpfs and stray layers,
snapshots nothing holds and snapshot files no record names, and the user-namespace
helpers a killed forker left (``idmap.orphaned_helpers``, any home's).

A cluster host's home holds a lease (:class:`ClusterLease`, written by its host actor,
renewed while the cluster vouches for it): once the lease is fenced (the head gave the
host up and retried its work elsewhere) or has run out (no actor renews it), nothing in
the home is the cluster's any more, so gc removes every workspace and snapshot of it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from ...config import Config
from .. import snapshot
from ..agent_host import bundle as agent_bundle
from ..container import idmap, range_views, statefs
from ..container import lifecycle as container
from ..container.cgroups import Layout, WorkspaceCgroup
from ..kernel import syscalls as sc
from ..net import attach as net
from ..oci import store as oci_store
from ..state import idranges
from ..state.entries import remove_entry
from ..state.records import WorkspaceState
from ..state.store import Store


@dataclass
class GcReport:
    workspaces: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    image_layers: list[str] = field(default_factory=list)
    network: list[str] = field(default_factory=list)  # veths and nftables tables

    @property
    def total(self) -> int:
        return (len(self.workspaces) + len(self.mounts) + len(self.cgroups) + len(self.processes)
                + len(self.files) + len(self.snapshots) + len(self.image_layers) + len(self.network))


LEASE_NAME = "cluster-lease.json"


@dataclass(frozen=True)
class ClusterLease:
    """What a cluster host's home says about who owns what it holds."""

    host: str
    epoch: int  # the cluster's epoch for this host when its contents were made
    expires_at: float | None  # wall clock; ``None``: parked (the cluster stopped the host on purpose)
    fenced: bool = False  # the head gave this epoch up

    def lost(self, now: float | None = None) -> bool:
        return self.fenced or (self.expires_at is not None and (now or time.time()) >= self.expires_at)


def lease_path(cfg: Config) -> Path:
    return cfg.home / LEASE_NAME


def read_lease(cfg: Config) -> ClusterLease | None:
    """The home's cluster lease (``None``: not a cluster host's home, or unreadable)."""
    try:
        fd = os.open(lease_path(cfg), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            d = json.loads(f.read(4096))
        return ClusterLease(str(d["host"]), int(d["epoch"]),
                            None if d["expires_at"] is None else float(d["expires_at"]), bool(d.get("fenced")))
    except (ValueError, KeyError, TypeError, OSError):
        return None


def write_lease(cfg: Config, lease: ClusterLease | None) -> None:
    """Replace the home's lease (written aside, then renamed in); ``None`` removes it."""
    path = lease_path(cfg)
    if lease is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(f".{LEASE_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(lease)))
    os.replace(tmp, path)


def _drop_unowned_by_cluster(cfg: Config, store: Store, report: GcReport) -> None:
    """The home's lease is lost: every workspace and snapshot goes, then the lease."""
    for rec in store.list_workspaces():
        container.destroy(cfg, store, rec)
        report.workspaces.append(rec.id)
    for snap in snapshot.list_all(store):
        snapshot.remove(cfg, store, snap)
        report.snapshots.append(snap.id)
    write_lease(cfg, None)


def _owner_alive(pid: int | None) -> bool:
    return pid is not None and psutil.pid_exists(pid)


def collect(cfg: Config, store: Store, *, extra_owned: set[str] | None = None, release: bool = False) -> GcReport:
    """Remove stale records and everything not owned by a live record; with ``release``,
    also unmount bunshin's tmpfs if no workspace or snapshot is left."""
    report = GcReport()
    if (lease := read_lease(cfg)) is not None and lease.lost():
        _drop_unowned_by_cluster(cfg, store, report)
    for rec in store.list_workspaces():
        stale = (
            (rec.state == WorkspaceState.CREATING and not _owner_alive(rec.owner_pid))
            or (rec.state == WorkspaceState.RUNNING and not container.is_alive(rec))
            # a clone of a fork batch whose forker died before the batch was committed
            or (rec.state == WorkspaceState.RUNNING and rec.owner_pid is not None and not _owner_alive(rec.owner_pid))
            or rec.state in (WorkspaceState.DEAD, WorkspaceState.REMOVING)
        )
        if stale:
            container.destroy(cfg, store, rec)
            report.workspaces.append(rec.id)
    live = {r.id for r in store.list_workspaces()} | (extra_owned or set())
    ws_root = cfg.paths.workspaces

    # The views of host id ranges no live workspace holds, and reservations of ranges
    # whose workspace never came (``idranges``).
    held = {r.ids for r in store.list_workspaces() if r.id in live and r.ids is not None}
    report.mounts.extend(range_views.sweep(cfg, held))
    idranges.sweep(cfg, store)
    report.network.extend(net.sweep(cfg, store))  # slots of workspaces gone, links and tables no slot holds
    views = Path(os.path.realpath(cfg.paths.idmap))
    # Mounts beneath our tmpfs folder (deepest first) that belong to no live workspace
    # (bunshin's own images tmpfs and the ranges' views aside).
    for target in sorted(set(statefs.mounts_under(cfg.tmpfs)) - statefs.own_mounts(cfg), key=len, reverse=True):
        path = Path(target)
        if path.is_relative_to(views):
            continue
        rel = path.relative_to(ws_root) if path.is_relative_to(ws_root) else None
        if rel is None or rel.parts[0] not in live:
            sc.umount(target, sc.MNT_DETACH)
            report.mounts.append(target)

    # Cgroups named after workspaces nothing records (their processes die with them).
    layout = Layout.discover()
    for path in layout.find(cfg.cgroup_prefix):
        ws_id = path.name.removeprefix(cfg.cgroup_prefix)
        if ws_id not in live:
            cg = WorkspaceCgroup(layout.version, (("any", path),))
            report.processes.extend(cg.pids())
            cg.destroy()
            report.cgroups.append(str(path))

    # User-namespace helpers of a forker killed while it made a clone's views (``idmap``).
    report.processes.extend(idmap.kill_orphaned_helpers())
    # Workspace folders on tmpfs.
    if ws_root.is_dir():
        for d in ws_root.iterdir():
            if d.name not in live:
                shutil.rmtree(d, ignore_errors=True)
                report.files.append(str(d))
    # Half-built layers from an interrupted build, and agent layers of older agent
    # versions that no workspace or snapshot stacks on any more.
    layers = cfg.paths.layers
    if layers.is_dir():
        in_use = snapshot.held_layers(store) | {
            p for s in snapshot.list_all(store) for p in (s.layer, *s.lowers)
        }
        current = agent_bundle.current_layer_name()
        for d in layers.iterdir():
            stale_build = d.name.startswith(".") and not _recent(d)
            old_agent = d.name.startswith("agent-") and d.name != current and str(d) not in in_use
            if stale_build or old_agent:
                shutil.rmtree(d, ignore_errors=True)
                report.files.append(str(d))
    # Snapshots nothing holds (their forker died) and snapshot files no record names.
    for item in snapshot.sweep(cfg, store):
        (report.files if "/" in item else report.snapshots).append(item)
    # Image layers no image, workspace or snapshot stacks (and stale staging of loads).
    report.image_layers.extend(free_image_layers(cfg, store))
    report.files.extend(stale_transfers(cfg))
    if release and not store.list_workspaces() and not snapshot.list_all(store) and statefs.release(cfg):
        report.mounts.append(str(cfg.tmpfs))
    return report


def free_image_layers(cfg: Config, store: Store) -> list[str]:
    """Remove the store's image layers nothing uses (``oci.store.free``) and unmount the
    stacks of deep images (``idmap.stack``) no workspace or snapshot stacks on; what went."""
    stacks = [[*s.lowers] for s in snapshot.list_all(store)] + [[*w.lowers] for w in store.list_workspaces()]
    freed = oci_store.free(cfg, store, [p for s in snapshot.list_all(store) for p in (s.layer, *s.lowers)])
    keep = {idmap.stack_target(cfg, run) for lowers in stacks if len(run := idmap.image_run(cfg, lowers)) >= 2}
    return freed + idmap.release_stacks(cfg, keep)


def stale_transfers(cfg: Config) -> list[str]:
    """Remove snapshot archives a dead server left in ``home/transfers`` (``NAME-PID-HEX``;
    anything else there older than a minute); what went."""
    root, gone = cfg.paths.transfers, list[str]()
    if not root.is_dir():
        return gone
    for p in root.iterdir():
        parts = p.name.split(".")[0].split("-")
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if (pid is not None and not psutil.pid_exists(pid)) or (pid is None and not _recent(p)):
            remove_entry(p)
            gone.append(str(p))
    return gone


def _recent(path: Path, seconds: float = 60.0) -> bool:
    import time

    try:
        return time.time() - path.stat().st_mtime < seconds
    except OSError:
        return False
