"""Taking a snapshot: one ``criu dump --leave-running`` of a workspace plus a frozen copy of
its upper layer taken while its tasks are frozen (the ``post-dump`` action). In ``cow``
mode the dump is then rewritten (``memfile``) so that private anonymous memory becomes
private mappings of memory files on tmpfs: every restore maps the same pages
copy-on-write. The memory files are hard-linked into the snapshot's layer under
``/.bunshin/mem``, which is how restored tasks (and forks of them) see them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from ...config import Config
from ...errors import (
    BunshinError,
    CriuError,
    InvalidArgument,
    ResourceExhausted,
    SnapshotNotFound,
    StateConflict,
)
from .. import memfile
from ..agent_host.client import quiesced
from ..agent_host.trim import before_freeze as trim_agent
from ..container import lifecycle as container
from ..container import range_views, statefs
from ..container.cgroups import WorkspaceCgroup
from ..container.idmap import share as share_view
from ..criu import (
    clone_images,
    fork_boost,
    joined_ns,
    netns_image,
)
from ..criu import dump_conf as criu_dump_conf
from ..criu import run as criu
from ..memfile import criu_images
from ..net import attach as net
from ..state.records import Mount, SnapshotMode, WorkspaceRecord, WorkspaceState
from ..state.store import Store
from . import precopy, unforkable, upper_copy
from .fork_checks import check as check_forkable
from .lifetime import KIND, MEM_VIEW, MODES, SnapshotRecord, claim, finish, get, unclaim
from .sweeping import _delete

# CRIU runs inside the workspace's network namespace (``criu.Placement``), so the
# namespace itself is not dumped. Its tasks are frozen, but the kernel's TCP timers are
# not: a zero-window probe, a retransmission or a delayed ACK moves data between two
# sockets while CRIU reads one after the other, and the clone gets a pair whose sequence
# numbers disagree (it stalls for good), or the dump fails ("recv failed"). So a dump of a
# workspace that holds a connection locks each one with CRIU's own lock
# (``netns_image.dump_lock``); a restore locks the clone's namespace (``netns_image``).
_COMMON = ["--file-locks", "--tcp-established", "--link-remap"]
# /sys is a sysfs the host mounts (a workspace's user namespace may not: see
# ``init``): external to CRIU, a fresh one for each clone (``Placement.sysfs``).
SYS_EXTERNAL = "bunshin-sys"
DUMP_EXTERNAL = ["--external", f"mnt[/sys]:{SYS_EXTERNAL}"]
_TS = re.compile(r"^\((\d+\.\d+)\)")


def _share(cfg: Config, ids: int | None, m: Mount) -> Path:
    return share_view(cfg, m) if ids is None else range_views.share(cfg, ids, m)


def mount_externals(mounts: Sequence[Mount], *, dump: bool, cfg: Config | None = None,
                    ids: int | None = None) -> list[str]:
    """Shared host folders (``--mount``) are external to CRIU too, keyed by their place in
    the record: dumped by path, restored from the host's view (``idmap.share``; the view of
    the clone's range ``ids``: ``range_views.share``), so a clone shares the very folder
    its parent does."""
    out: list[str] = []
    for i, m in enumerate(mounts):
        key = f"bunshin-mnt-{i}"
        if dump:
            out += ["--external", f"mnt[{m.path}]:{key}"]
        elif cfg is None:
            raise TypeError("the restore side of mount_externals needs cfg")
        else:
            out += ["--external", f"mnt[{key}]:{_share(cfg, ids, m)}"]
    return out


def take(cfg: Config, store: Store, rec: WorkspaceRecord, *, keep: bool,
         mode: SnapshotMode | str = SnapshotMode.COW) -> SnapshotRecord:
    """Dump a running workspace (it keeps running) into a new snapshot.

    A ``keep=False`` snapshot stays owned by this process (``sweep`` leaves it
    alone) until ``release``: restore from it first (``fork`` does both).
    """
    if mode not in MODES:
        raise InvalidArgument(f"unknown fork mode {mode!r}", hint=f"use one of {', '.join(MODES)}")
    mode = SnapshotMode(mode)
    if rec.state != WorkspaceState.RUNNING or not container.is_alive(rec):
        raise StateConflict(f"workspace {rec.id} is not running", hint="only a running workspace can be forked")
    tree = _tree(rec.pid)
    check_forkable(rec.id, tree)  # what CRIU cannot carry: refused before anything is frozen
    ghost_limit = unforkable.ghost_limit(cfg)
    snap_id = "snap-" + secrets.token_hex(6)
    sdir = cfg.paths.snapshot(snap_id)
    images, layer = sdir / "images", cfg.paths.layer(snap_id)
    parent = _source_snapshot(store, rec)
    snap = SnapshotRecord(
        id=snap_id, source=rec.id, image=rec.image, mode=mode, keep=keep, created_at=time.time(),
        images=str(images), layer=str(layer), lowers=rec.lowers, memfiles=(), mounts=rec.mounts,
        memory_limit=rec.memory_limit, pids_limit=rec.pids_limit, hostname=rec.hostname,
        depth=(parent.depth + 1) if parent else 1, dump_ms=0, pause_ms=0, rewrite_ms=0,
        memfile_bytes=0, image_bytes=0, layer_bytes=0, owner_pid=os.getpid(), network=rec.network,
        net_policy=_net_policy(cfg, store, rec),
    )
    claim(snap_id)
    store.put_object(KIND, snap_id, snap.to_json())  # recorded first: a crash leaves it to gc
    boost: fork_boost.Boost | None = None
    try:
        huge_memfiles = statefs.ensure(cfg)
        images.mkdir(parents=True)
        upper_bytes = _check_space(cfg, rec, tree)
        live = None
        if cfg.fork_precopy and mode is SnapshotMode.COW and cfg.memory_semantics == "trap":
            if precopy.wanted(cfg, tree):  # (a process started since is left to the dump)
                live = precopy.convert(cfg, rec.id, Path(rec.root), MEM_VIEW, tree)
                live.save(sdir)
                _check_space(cfg, rec, tree, upper_bytes)  # what is left to the dump must still fit (a tmpfs filled meanwhile)
        # Tasks are frozen with ptrace, not the v1 freezer cgroup: CRIU polls the
        # freezer every 100 ms, which adds ~100 ms to every parent pause. Cgroups
        # are not dumped either: a restore runs criu inside the clone's own.
        # criu as the tree's user namespace's owner (its range's root): the capabilities it
        # needs over the tree's tasks (prlimit: CAP_SYS_RESOURCE) are the owner's there
        inside = criu.Placement(netns=f"/proc/{rec.pid}/ns/net", owner=rec.ids)
        seen = None
        locked = netns_image.dump_lock(rec.pid or 0)  # (read before the freeze)
        try:
            # the upper copied while CRIU dumps (``upper_copy``: early) and criu in the tree's
            # UTS and IPC namespaces (``joined_ns``); dumped again without both when CRIU
            # linked an open file back into the upper meanwhile, or had SysV objects to dump
            join = not joined_ns.sysv_objects(rec.pid or 0)  # (read before the freeze)
            for early in (images, None):
                reader = joined_ns.Reader(rec.pid or 0) if early and join else None
                try:
                    with upper_copy.frozen_copy(cfg, Path(rec.upper), layer, sdir, _memory_cgroup(rec),
                                                early=early) as copy, \
                            quiesced(Path(rec.root).parent):  # no host call may hold a connection into it
                        trim_agent(rec)  # its waiting threads end first: CRIU dumps each thread in the pause
                        extra = [*_COMMON, *DUMP_EXTERNAL, "--manage-cgroups=ignore", "--ghost-limit", str(ghost_limit),
                                 "--network-lock", locked]
                        extra += mount_externals(rec.mounts, dump=True)
                        extra += precopy.dump_externals(rec.pid, MEM_VIEW)  # live files' binds (one copy, in paths.mem)
                        where = inside if reader is None else dataclasses.replace(
                            inside, utsns=f"/proc/{rec.pid}/ns/uts", ipcns=f"/proc/{rec.pid}/ns/ipc")
                        run = criu.dump(cfg.criu, rec.pid or 0, images, leave_running=True, extra=extra,
                                        placement=where, log_level=cfg.dump_log_level,
                                        notify=copy.notify if reader is None else reader.notify(copy.notify),
                                        rpc_config=criu_dump_conf.ensure(cfg.paths.helpers))
                    seen = reader.result() if reader is not None else None
                    break
                except (upper_copy.LinkedRemaps, joined_ns.HasSysvObjects):
                    upper_copy.start_over(images, layer)
                except CriuError as e:  # a SysV segment made and mapped after the look above
                    if reader is None or joined_ns.SYSV_SHM_ELSEWHERE not in str(e):
                        raise
                    upper_copy.start_over(images, layer)
                finally:
                    if reader is not None:
                        reader.close()
        except CriuError as e:  # what CRIU cannot carry, named (a ghost over the limit, a watch it cannot record)
            refusal = unforkable.find(cfg, rec.id, rec.pid, str(e))
            if refusal is None:
                raise
            raise refusal from e
        finally:
            if locked != netns_image.NO_LOCK:  # CRIU ignores a failed unlock: the parent's connections would stall
                netns_image.unlocked(rec.pid or 0)
        if live is not None and live.converted and live.cpu_boost > 1:  # after the dump (run at SCHED_FIFO: not in that cgroup)
            boost = fork_boost.start(live.cpu_boost)  # the rest of a pre-copied fork weighed up too
        if not layer.is_dir():
            raise BunshinError(f"the upper layer of {rec.id} was not frozen", hint="see the dump log")
        if seen is not None:
            joined_ns.add(images, seen)  # the UTS and IPC namespaces criu was in, as CRIU writes them
        netns_image.add(images, cfg.id_count)  # a clone's network namespace is its user namespace's
        clone_images.canonical(cfg, images)  # each clone maps it onto its own range (``clone_images.make``)
        precopy.drop_binds(images)  # the clones reach the live files through their layer, by the same path
        files: tuple[str, ...] = ()
        rewrite_ms, mem_bytes, layer_bytes = 0.0, 0, _du(layer)
        if mode is SnapshotMode.COW:
            result = memfile.rewrite_images(
                images, cfg.paths.mem, memfile_view=MEM_VIEW, root=Path(rec.root), tag=snap_id,
                # [heap] too: Python (the agent, most tools) keeps most objects there; left
                # anonymous a Python clone owns ~85 MiB instead of ~2 MiB. glibc stays correct.
                convert_heap=True,
                huge_pages=huge_memfiles, consume_pages=True,
                zero_fill=memfile.ZeroFillPolicy(cfg.memory_semantics), trap_cache=cfg.paths.sigsys,
            )
            files = tuple(str(f.path) for f in result.files)
            rewrite_ms, mem_bytes = result.duration_ms, result.data_bytes
        # copy mode too: nothing the workspace left at /.bunshin/mem stays; live files its processes map
        _link_memfiles((*files, *precopy.link_names(cfg, images, MEM_VIEW)), layer)
        taken = dict(
            memfiles=files, dump_ms=run.duration_ms,
            pause_ms=(_pause_ms(images, run.log) or run.duration_ms) + (live.pause_ms if live else 0.0),
            rewrite_ms=rewrite_ms, memfile_bytes=mem_bytes + (live.bytes if live else 0), image_bytes=_du(images),
            layer_bytes=layer_bytes,
            owner_pid=None if keep else snap.owner_pid,  # a fork's snapshot stays owned until `release`
        )
        done = finish(store, snap, **taken)
        if keep:
            unclaim(snap_id)
        return done
    except BaseException:
        try:
            _delete(cfg, store, snap)
        finally:
            unclaim(snap_id)
        raise
    finally:
        if boost is not None:
            boost.close()


def _source_snapshot(store: Store, rec: WorkspaceRecord) -> SnapshotRecord | None:
    if rec.snapshot is None:
        return None
    try:
        return get(store, rec.snapshot)
    except SnapshotNotFound:
        return None


def _check_space(cfg: Config, rec: WorkspaceRecord, tree: list[int], upper: int | None = None) -> int:
    """Refuse early when tmpfs cannot hold the memory of the workspace's ``tree`` and its upper once more;
    the upper's bytes (``upper``: as measured already, not walked again)."""
    st = os.statvfs(cfg.tmpfs)
    free = st.f_bavail * st.f_frsize
    if upper is None:
        upper = _du(Path(rec.upper))
    # what the dump writes to memory files: the tree's anonymous memory, from counters (USS
    # walks every page table: 44-48 ms for a 4 GiB process at load ~1, against 0.1-0.3 ms)
    need = upper + sum(precopy.anon_bytes(pid) for pid in tree)
    if need > free:
        raise ResourceExhausted(
            f"tmpfs {cfg.tmpfs} has {free >> 20} MiB free, the snapshot of {rec.id} needs about {need >> 20} MiB",
            hint="remove snapshots or workspaces, or point BUNSHIN_TMPFS at a larger tmpfs",
        )
    limit = rec.memory_limit
    left = None if limit is None else limit - WorkspaceCgroup.of_record(rec).memory_bytes()
    if limit is not None and left is not None and upper > left:
        raise ResourceExhausted(
            f"the frozen copy of {rec.id}'s files ({upper >> 20} MiB) is charged to it, and its memory limit "
            f"({limit >> 20} MiB) has {max(left, 0) >> 20} MiB left",
            hint="delete files in the workspace (/tmp, build output) or give it a larger --memory",
        )
    return upper


def _memory_cgroup(rec: WorkspaceRecord) -> Path | None:
    return next((Path(p) for c, p in rec.cgroups if c == "memory"), None)


def _tree(pid: int | None) -> list[int]:
    if pid is None:
        return []
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return []


def _link_memfiles(files: Sequence[str], layer: Path) -> None:
    """Give a new frozen layer a host-made ``/.bunshin/mem`` holding links of ``files``.

    The layer is a copy of what the workspace wrote, symlinks included, so whatever it
    left at ``/.bunshin`` (if not a folder) or at ``/.bunshin/mem`` (a symlink to a host
    folder, a file, a folder of its own entries) is removed first without following
    anything, and the links are made through the new folder's descriptor. The memory
    files themselves stay in ``Config.paths.mem``, which no workspace reaches.
    """
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part, fresh in zip(Path(MEM_VIEW).relative_to("/").parts, (False, True), strict=True):
            child = _host_dir_at(fd, part, fresh=fresh)
            os.close(fd)
            fd = child
        for f in files:
            with memfile.unsealed(Path(f)):
                os.link(f, Path(f).name, dst_dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def _host_dir_at(dir_fd: int, name: str, *, fresh: bool) -> int:
    """A descriptor of a real folder ``name`` in ``dir_fd``. A folder there is kept unless
    ``fresh``; anything else (or a ``fresh`` folder) is removed without following it
    (``rmtree`` relative to a descriptor walks by descriptors) and a new one made."""
    try:
        mode: int | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and (fresh or not stat.S_ISDIR(mode)):
        if stat.S_ISDIR(mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
        mode = None
    if mode is None:
        os.mkdir(name, 0o755, dir_fd=dir_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    if mode is None:
        os.fchmod(fd, 0o755)  # whatever the umask
    return fd


def _pause_ms(images: Path, log: Path) -> float | None:
    """How long the dumped tasks were frozen: CRIU's own ``frozen_time`` (stats-dump),
    else freeze-to-thaw from its timestamped log."""
    with contextlib.suppress(OSError, BunshinError, KeyError, IndexError, TypeError, ValueError):
        stats = criu_images.load(images / "stats-dump")["entries"][0]["dump"]
        return round(int(stats["frozen_time"]) / 1000, 2)
    start = end = None
    try:
        for line in log.read_text(errors="replace").splitlines():
            m = _TS.match(line)
            if not m:
                continue
            t = float(m.group(1))
            low = line.lower()
            if start is None and ("freezing" in low or "freeze" in low):
                start = t
            if "unfreez" in low or "unlock network" in low:
                end = t
    except OSError:
        return None
    return round((end - start) * 1000, 2) if start is not None and end is not None else None


def _du(path: Path) -> int:
    """Bytes allocated under ``path``, walked by descriptors (``os.fwalk``): a running
    workspace's upper may swap a folder for a symlink meanwhile, which is not followed."""
    total = 0
    for _, _, files, dir_fd in os.fwalk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(f, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
    return total


def _net_policy(cfg: Config, store: Store, rec: WorkspaceRecord) -> dict[str, Any] | None:
    """The egress policy of ``rec`` now (its clones start with it), or None without egress."""
    policy = net.policy_of(cfg, store, rec.id) if rec.network != "none" else None
    return None if policy is None else policy.to_dict()
