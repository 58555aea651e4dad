"""Snapshots of running workspaces, and restores from them: the live fork.

A snapshot is one ``criu dump --leave-running`` of a workspace plus a frozen copy of
its upper layer taken while its tasks are frozen (the ``post-dump`` action). In
``cow`` mode the dump is then rewritten (``memfile``) so that private anonymous
memory becomes private mappings of memory files on tmpfs: every restore maps the
same pages copy-on-write. The memory files are hard-linked into the snapshot's
layer under ``/.bunshin/mem``, which is how restored tasks (and forks of them)
see them, and nothing else does.

A restore builds a new workspace: an overlay of ``[snapshot layer, *source lowers]``
with a fresh upper, fresh cgroups with the source's limits, and ``criu restore``
into them with new namespaces. A batch of restores returns every workspace or
rolls back all of them.

Lifetime: a snapshot taken by ``fork`` lives while any workspace stacks on its
layer; one taken explicitly (``keep``) lives until removed. While a process is
still taking, forking or loading one (``owner_pid``), nothing frees it. ``sweep``
frees whatever nothing holds: records, image folders, layers and memory files,
also those no record names any more (a crash, or the ancestors of a loaded
snapshot).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ..config import Config
from ..errors import (
    BunshinError,
    CriuError,
    InvalidArgument,
    ResourceExhausted,
    RuntimeFailure,
    SnapshotNotFound,
    StateConflict,
)
from . import (
    budget,
    cgroup_moves,
    clone_images,
    container,
    criu,
    criu_dump_conf,
    fork_boost,
    host_limits,
    idranges,
    joined_ns,
    memfile,
    netns_image,
    precopy,
    range_views,
    restore_boost,
    restore_check,
    statefs,
    unforkable,
    upper_copy,
    userns_owner,
)
from . import syscalls as sc
from .agent_client import quiesced
from .agent_trim import before_freeze as trim_agent
from .cgroups import Layout, WorkspaceCgroup
from .fork_checks import check as check_forkable
from .idmap import share as share_view
from .memfile import criu_images
from .records import Mount, SnapshotMode, WorkspaceRecord, WorkspaceState, mounts_from_json
from .store import Store

KIND = "snapshot"
MEM_VIEW = "/.bunshin/mem"
MODES = tuple(SnapshotMode)  # the values a caller may give, "cow" first
RESTORE_CONCURRENCY = 2
# CRIU runs inside the workspace's network namespace (``criu.Placement``), so the
# namespace itself is not dumped and the dump needs no network lock: every peer of a
# socket inside is frozen along with it. A restore locks the clone's (``netns_image``).
_COMMON = ["--network-lock", "skip", "--file-locks", "--tcp-established", "--link-remap"]
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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

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


# ------------------------------------------------------------------------- take


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
        memfile_bytes=0, image_bytes=0, layer_bytes=0, owner_pid=os.getpid(),
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
                        extra = [*_COMMON, *DUMP_EXTERNAL, "--manage-cgroups=ignore", "--ghost-limit", str(ghost_limit)]
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


# ---------------------------------------------------------------------- restore


def restore(cfg: Config, store: Store, snap: SnapshotRecord, n: int, *, keep_logs: bool = False
            ) -> list[WorkspaceRecord]:
    """``n`` new running workspaces from ``snap``; all of them or none. ``keep_logs``: each
    clone's criu log stays beside the images, named by ``extra["restore_log"]`` (the
    caller removes it; ``bench restore-phases``).

    All or none also under ``KeyboardInterrupt`` (pending restores are cancelled, the
    running ones awaited, every clone made is destroyed) and under ``kill -9``: each
    clone keeps this process as its ``owner_pid`` until the whole batch is in, so gc
    treats the clones of a dead forker as unfinished.
    """
    check_batch(n, _snapshot_tasks(snap))
    restore_boost.factor()  # a malformed setting refused before anything is made
    budget.check_room(store, snap.pids_limit, n)  # each clone's record is checked again as it is added
    cgroup_moves.ensure()  # criu's moves into the clone's cgroups: 0.03 ms instead of 3-17 (busy host)
    layout = Layout.discover()
    pool = ThreadPoolExecutor(max_workers=min(n, RESTORE_CONCURRENCY))
    futures: list[Future[WorkspaceRecord]] = []
    watch = restore_check.Watch().start()  # every restored process alive at the end, or the batch fails
    try:
        for _ in range(n):  # one by one: an interrupt mid-way still sees every submitted future
            futures.append(pool.submit(restore_boost.in_thread, _restore_one, cfg, store, snap, layout, keep_logs))
        done = [fut.result() for fut in futures]
        check_ms = restore_check.check(Path(snap.images), [(r.id, r.pid or 0) for r in done], watch)
        with store.transaction():  # the batch is in: the clones are the caller's now
            done = [store.update_workspace(rec.id, _committed(check_ms)) or _committed(check_ms)(rec) for rec in done]
        pool.shutdown()
        return done
    except BaseException as exc:
        _roll_back(cfg, store, pool, futures)
        limit = host_limits.explain_restore_failure(exc, n) if isinstance(exc, CriuError) else None
        if limit is not None:
            raise limit from exc
        raise
    finally:
        watch.close()


def _committed(check_ms: float) -> Callable[[WorkspaceRecord], WorkspaceRecord]:
    """A clone of a batch that is in: no owner, the batch's check cost in its ``extra``."""
    return lambda rec: rec.replace(owner_pid=None, extra={**rec.extra, "restore_check_ms": round(check_ms, 2)})


def _roll_back(cfg: Config, store: Store, pool: ThreadPoolExecutor, futures: Sequence[Future[WorkspaceRecord]]) -> None:
    """Cancel what has not started, wait for what runs, destroy every clone made.

    A second Ctrl-C does not cut this short: the clones would be left running.
    """
    for fut in futures:
        fut.cancel()
    while True:
        try:
            pool.shutdown(wait=True, cancel_futures=True)
            break
        except KeyboardInterrupt:
            continue
    for fut in futures:
        if fut.cancelled() or fut.exception() is not None:
            continue
        ws_id = fut.result().id
        while True:
            try:
                with contextlib.suppress(BunshinError):  # gone already
                    container.destroy(cfg, store, store.get_workspace(ws_id))
                break
            except KeyboardInterrupt:
                continue


#: Largest ``n`` of one ``fork``/``restore`` call.
MAX_BATCH = 1024
#: Memory a clone adds beyond what it shares with its snapshot (measured 140-320 KiB
#: private per clone plus kernel memory: tasks, page tables, namespaces; rounded up).
CLONE_MEMORY = 2 << 20
#: Share of ``kernel.pid_max`` a batch must leave free.
PID_MARGIN = budget.PID_MARGIN


def check_batch(n: int, tasks_per_clone: int) -> None:
    """Refuse a batch of ``n`` clones of ``tasks_per_clone`` tasks each that cannot fit."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidArgument(f"cannot make {n!r} clones", hint="give n >= 1")
    if n > MAX_BATCH:
        raise InvalidArgument(f"{n} clones in one call is more than the limit of {MAX_BATCH}",
                              hint=f"fork or restore in batches of at most {MAX_BATCH}")
    pid_max, existing = _pid_max(), _tasks_now()
    need = n * max(tasks_per_clone, 1)
    room = int(pid_max * (1 - PID_MARGIN)) - existing
    if need > room:
        raise ResourceExhausted(
            f"{n} clones of {tasks_per_clone} tasks need {need} pids; kernel.pid_max is {pid_max}, "
            f"{existing} are in use and {int(pid_max * PID_MARGIN)} stay spare, so {max(room, 0)} are left",
            hint=f"fork at most {max(room, 0) // max(tasks_per_clone, 1)} clones, remove workspaces, "
                 "or raise kernel.pid_max (sysctl -w kernel.pid_max=4194304)",
        )
    available = psutil.virtual_memory().available
    if n * CLONE_MEMORY > available:
        raise ResourceExhausted(
            f"{n} clones need about {n * CLONE_MEMORY >> 20} MiB ({CLONE_MEMORY >> 20} MiB each), "
            f"only {available >> 20} MiB of memory is available",
            hint=f"fork at most {available // CLONE_MEMORY} clones or remove workspaces to free memory",
        )


def _pid_max() -> int:
    return budget.pid_max()


def _tasks_now() -> int:
    """Threads on the machine now (the 4th field of /proc/loadavg: running/total)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _snapshot_tasks(snap: SnapshotRecord) -> int:
    """Tasks (threads) a restore of ``snap`` creates: CRIU writes one core image per thread."""
    with contextlib.suppress(OSError):
        return max(1, sum(1 for _ in Path(snap.images).glob("core-*.img")))
    return 1


def _live_tasks(rec: WorkspaceRecord) -> int:
    total = 0
    for pid in _tree(rec.pid):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/task"))
    return max(total, 1)


def criu_mounts(cfg: Config, snap: SnapshotRecord, wdir: Path, ids: int | None = None
                ) -> tuple[tuple[str, bool], ...]:
    """The host mounts a clone's criu sees (``Placement.own_mounts``), parents first:
    bunshin's tmpfs without what is mounted beneath it, the images' tmpfs, the clone's
    folder with its upper and root, the views of the shared folders. No other clone's."""
    trees = [(str(cfg.tmpfs), False), (str(cfg.paths.snapshots), False)]
    if not Path(snap.images).is_relative_to(cfg.paths.snapshots):
        trees.append((snap.images, False))
    trees.append((str(wdir), True))
    trees += [(str(_share(cfg, ids, m)), False) for m in snap.mounts]
    return tuple(trees)


def _restore_one(cfg: Config, store: Store, snap: SnapshotRecord, layout: Layout, keep_log: bool = False
                 ) -> WorkspaceRecord:
    ws_id = container.new_id()
    wdir = cfg.paths.workspace(ws_id)
    cg = WorkspaceCgroup.of(layout, cfg.cgroup_prefix + ws_id)
    t0 = time.perf_counter()
    ids = idranges.reserve(cfg, store, ws_id)
    rec = WorkspaceRecord(
        id=ws_id, name=None, image=snap.image, state=WorkspaceState.CREATING, created_at=time.time(),
        root=str(wdir / "root"), upper=str(wdir / "upper"), work=str(wdir / "work"),
        lowers=(snap.layer, *snap.lowers), cgroup_version=layout.version, cgroups=cg.dirs_as_str(),
        memory_limit=snap.memory_limit, pids_limit=snap.pids_limit, hostname=snap.hostname,
        owner_pid=os.getpid(), parent=snap.source, snapshot=snap.id, mounts=snap.mounts, ids=ids,
    )
    try:
        budget.add_within(store, rec)
    except BaseException:
        idranges.free(cfg, store, ids)
        raise
    try:
        container.make_workspace_dir(rec, cfg.id_base)
        container.mount_overlay(rec, cfg)
        container.publish_identity(rec, {"workspace_id": ws_id, "fork_id": ws_id, "parent": snap.source,
                                         "snapshot": snap.id, "depth": snap.depth})
        WorkspaceCgroup.create(layout, cfg.cgroup_prefix + ws_id, memory=snap.memory_limit, pids=snap.pids_limit)
        boosted = restore_boost.boost(cg, restore_boost.factor())  # criu and the tasks it forks first
        # criu starts inside the clone's cgroups and a fresh network namespace with
        # lo up; the restored tasks inherit both.
        sysfs = str(wdir / "sys")  # beneath the clone's folder: unmounted with it
        os.mkdir(sysfs, 0o755)
        # the clone's user namespace mapped onto its range and owned by its root (``userns_owner``)
        images = clone_images.make(Path(snap.images), ws_id, ids)
        into = criu.Placement(new_netns=True, own_keyring=True, sysfs=sysfs,
                              hold_netns=netns_image.restores_netns(Path(snap.images)),
                              cgroup_procs=tuple(str(p / "cgroup.procs") for p in cg.paths),
                              own_mounts=criu_mounts(cfg, snap, wdir, ids),
                              preload=str(userns_owner.library(cfg)))
        t1 = time.perf_counter()
        run = criu.restore(
            cfg.criu, images, pidfile=wdir / "pid", root=Path(rec.root),
            extra=[*_COMMON, "--external", f"mnt[{SYS_EXTERNAL}]:{sysfs}", "--manage-cgroups=ignore",
                   *mount_externals(rec.mounts, dump=False, cfg=cfg, ids=ids)],
            placement=into,
            keep_log=keep_log,  # written from inside the clone's cgroup: it would be charged to it
            log_level=4 if keep_log else cfg.restore_log_level,  # a kept log is read: every step
        )
        assert run.pid is not None
        kept = clone_images.drop(images, keep=run.log if keep_log else None)
        if userns_owner.owner_of(run.pid) != ids:  # never a clone whose namespace host root owns
            raise RuntimeFailure(f"the user namespace of clone {ws_id} is owned by host uid "
                                 f"{userns_owner.owner_of(run.pid)}, not its own root {ids}",
                                 hint="its criu did not load bunshin's userns_owner helper: run criu through "
                                      "the wrapper make install writes, or a script that keeps LD_PRELOAD")
        if boosted:
            restore_boost.settle(cg)
        t2 = time.perf_counter()
        if into.hold_netns:  # CRIU made the clone's namespace; criu's own had the setting already (``new_netns``)
            netns_image.restored(run.pid)
        pid_start = psutil.Process(run.pid).create_time()
        # what this clone's restore cost, step by step (``bench fork``): its record, folder,
        # overlay, identity and cgroups; the criu run (spawn to exit, ``restore_ms``); the
        # pidfile and network lock after it
        steps = {"prepare": (t1 - t0) * 1000, "criu_call": (t2 - t1) * 1000, "after": (time.perf_counter() - t2) * 1000}
        # owner_pid stays set until ``restore`` commits the whole batch
        started = {"state": WorkspaceState.RUNNING, "pid": run.pid, "pid_start": pid_start,
                   "extra": {"restore_ms": round(run.duration_ms, 2),
                             "restore_steps_ms": {k: round(v, 2) for k, v in steps.items()},
                             **({"restore_log": str(kept)} if keep_log else {})}}
        return store.update_workspace(ws_id, lambda r: r.replace(**started)) or rec.replace(**started)
    except BaseException:
        clone_images.drop(Path(snap.images) / f"{clone_images.CLONE_PREFIX}{ws_id}")
        container.destroy(cfg, store, store.get_workspace(ws_id))
        raise


# ----------------------------------------------------------------- lifetime


def fork(cfg: Config, store: Store, rec: WorkspaceRecord, n: int, *, mode: SnapshotMode | str = SnapshotMode.COW
         ) -> tuple[SnapshotRecord, list[WorkspaceRecord]]:
    """One dump of ``rec`` and ``n`` restores from it; all clones or none.

    The snapshot lives on while the clones stack on it and is freed with the last;
    if the restores fail or are interrupted it is freed at once.
    """
    check_batch(n, _live_tasks(rec))  # before the dump: a refused fork creates nothing
    budget.check_room(store, rec.pids_limit, n)
    snap = take(cfg, store, rec, keep=False, mode=mode)
    try:
        clones = restore(cfg, store, snap, n)
    finally:
        snap = release(store, snap)
        sweep(cfg, store)
    return snap, clones


def release(store: Store, snap: SnapshotRecord) -> SnapshotRecord:
    """Clear the snapshot's owner: from now on ``sweep`` may free it when nothing holds it."""
    unclaim(snap.id)
    return update(store, snap.id, owner_pid=None) or snap


def remove(cfg: Config, store: Store, snap: SnapshotRecord) -> None:
    """Drop an explicit snapshot; its files go once no workspace stacks on it."""
    if update(store, snap.id, keep=False) is None:
        raise SnapshotNotFound(f"no snapshot {snap.id!r}", hint="`bunshin tree` lists snapshots")
    sweep(cfg, store)


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


def sweep(cfg: Config, store: Store) -> list[str]:
    """Delete every snapshot nothing holds, then files no record names; returns what went.

    A snapshot whose maker died half-way (``owner_pid`` dead) goes too, unless
    workspaces already stack on it.
    """
    held = held_layers(store)
    freed = []
    for s in list_all(store):
        if not _retained(s) and s.layer not in held:
            _delete(cfg, store, s)
            freed.append(s.id)
    return freed + _sweep_orphans(cfg, store)


def _sweep_orphans(cfg: Config, store: Store) -> list[str]:
    """Remove snapshot layers, image folders and memory files that no record names.

    Records are always written before the files they name, so anything unnamed is
    left over (from a crash, or the ancestor layers of a removed loaded snapshot).
    The files are listed *before* the records are read: a snapshot being taken
    concurrently has its record in place by the time its files can be seen.
    """
    layers, sdir, mdir = cfg.paths.layers, cfg.paths.snapshots, cfg.paths.mem
    layer_dirs = sorted(layers.glob("snap-*")) if layers.is_dir() else []
    image_dirs = sorted(sdir.iterdir()) if sdir.is_dir() else []
    mem_files = sorted(mdir.glob(f"*{memfile.SUFFIX}")) if mdir.is_dir() else []
    all_layers = {d.name for d in layers.iterdir()} if layers.is_dir() else set()
    snaps = list_all(store)
    named = {Path(p).name for p in held_layers(store)}
    named.update(Path(p).name for s in snaps for p in (s.layer, *s.lowers))
    ids = {s.id for s in snaps}
    freed: list[str] = []
    for d in layer_dirs:
        if d.name not in named and d.name not in ids:
            remove_layer(d)
            freed.append(str(d))
    live = {r.id for r in store.list_workspaces()}
    for d in image_dirs:
        if d.name not in ids:
            shutil.rmtree(d, ignore_errors=True)
            freed.append(str(d))
    for snp in snaps:  # a clone's images folder its restore left (``clone_images``)
        freed += clone_images.sweep(Path(snp.images), live)
    tags = ids | named | (all_layers - {Path(f).name for f in freed})
    for f in mem_files:
        if memfile_tag(f.name) not in tags and not precopy.sweep_keeps(f, live):
            memfile.remove_memfile(f)
            freed.append(str(f))
    return freed


def memfile_tag(name: str) -> str:
    """The snapshot id a memory file was written for (``<snap id>-<pid>.bunshin-mem``)."""
    return name.removesuffix(memfile.SUFFIX).rsplit("-", 1)[0]


def remove_layer(layer: Path) -> None:
    """Delete a frozen layer: the links in its ``/.bunshin/mem`` (memory files are
    immutable: their flag goes first), then the folder.

    A layer that failed half-way in ``take`` still holds what the workspace left there,
    so only regular files reached through ``O_NOFOLLOW`` folder descriptors are opened;
    a symlink (to a host folder at ``/.bunshin`` or ``mem``, or named like a memory file
    and pointing at a host file) is unlinked as itself or skipped, never followed.
    """
    try:
        fd = sc.open_dir_beneath(layer, Path(MEM_VIEW).relative_to("/").parts)
    except OSError:
        fd = None
    if fd is not None:
        try:
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    memfile.remove_memfile_at(fd, name)
        finally:
            os.close(fd)
    shutil.rmtree(layer, ignore_errors=True)  # by descriptors: a symlink inside is unlinked, not followed


def _delete(cfg: Config, store: Store, snap: SnapshotRecord) -> None:
    """Free a snapshot's files and its record. Only paths where bunshin puts them are
    touched (a record may come from a loaded folder, which is untrusted input)."""
    mdir = cfg.paths.mem
    for f in snap.memfiles:
        if Path(f).parent == mdir and Path(f).name.endswith(memfile.SUFFIX):
            memfile.remove_memfile(Path(f))
    layer, sdir = Path(snap.layer), Path(snap.images).parent
    if layer.parent == cfg.paths.layers and layer.name not in ("", ".", ".."):
        remove_layer(layer)
    if sdir.parent == cfg.paths.snapshots and sdir.name not in ("", ".", ".."):
        shutil.rmtree(sdir, ignore_errors=True)
    store.delete_object(KIND, snap.id)
