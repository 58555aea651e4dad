"""Restoring a snapshot, and ``fork`` (take, then restore).

A restore builds a new workspace: an overlay of ``[snapshot layer, *source lowers]``
with a fresh upper, fresh cgroups with the source's limits, and ``criu restore`` into
them with new namespaces. A batch of restores returns every workspace or rolls back
all of them; ``check_batch`` refuses one that cannot fit before anything is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import FrameType

import psutil

from ...config import Config
from ...errors import (
    BunshinError,
    CriuError,
    InvalidArgument,
    ResourceExhausted,
    RuntimeFailure,
    StateConflict,
)
from ..container import cgroup_moves
from ..container import lifecycle as container
from ..container.cgroups import Layout, WorkspaceCgroup
from ..criu import (
    clone_images,
    netns_image,
    restore_boost,
    restore_check,
    userns_owner,
)
from ..criu import run as criu
from ..kernel import host_limits
from ..net import attach as net
from ..net.policy import NetworkMode, Policy
from ..net.slots import Slot
from ..state import budget, idranges
from ..state.records import MADE_AHEAD, SnapshotMode, WorkspaceRecord, WorkspaceState
from ..state.store import Store
from .lifetime import SnapshotRecord, release
from .sweeping import sweep
from .taking import _COMMON, SYS_EXTERNAL, _share, _tree, mount_externals, take

RESTORE_CONCURRENCY = 2


def restore(cfg: Config, store: Store, snap: SnapshotRecord, n: int, *, keep_logs: bool = False,
            ids: Sequence[str] | None = None, ready: Ready | None = None) -> list[WorkspaceRecord]:
    """``n`` new running workspaces from ``snap``; all of them or none. ``ids``: the ids they
    take (``n`` of them, each free: a workspace that was removed may come back under its own
    id, as E2B's resumed sandboxes do); else new ones. ``keep_logs``: each
    clone's criu log stays beside the images, named by ``extra["restore_log"]`` (the
    caller removes it; ``bench restore-phases``).

    All or none also under ``KeyboardInterrupt`` (pending restores are cancelled, the
    running ones awaited, every clone made is destroyed; the one restore of ``n == 1``
    runs in the calling thread, which takes a Ctrl-C when it is done) and under ``kill -9``: each
    clone keeps this process as its ``owner_pid`` until the whole batch is in, so gc
    treats the clones of a dead forker as unfinished.

    ``ready``: the one clone of a restore of one (no ``ids``, logs or network), made ahead
    (``prepare_one``, ``ahead``): only its criu run and what follows are left. It is given
    up: destroyed if the restore fails.
    """
    try:
        check_batch(n, _snapshot_tasks(snap))
        if ready is not None and (n != 1 or ids is not None or keep_logs or snap.network == NetworkMode.EGRESS
                                  or ready.rec.snapshot != snap.id):
            raise InvalidArgument(f"a clone made ahead of snapshot {ready.rec.snapshot} cannot finish a restore of "
                                  f"{n} of {snap.id}" + (" with ids, logs or network" if n == 1 else ""),
                                  hint="give a clone made ahead only to a plain restore of one of its snapshot")
        given = _free_ids(store, ids, n)
        restore_boost.factor()  # a malformed setting refused before anything is made
        if ready is None:  # one made ahead is in the budget already
            budget.check_room(store, snap.pids_limit, n)  # each clone's record is checked again as it is added
        cgroup_moves.ensure()  # criu's moves into the clone's cgroups: 0.03 ms instead of 3-17 (busy host)
        layout = Layout.discover()
    except BaseException:
        if ready is not None:
            discard(cfg, store, snap, ready.rec.id)
        raise
    net_slots: dict[str, Slot] = {}
    if snap.network == NetworkMode.EGRESS:  # every clone's slot and table made ahead, in one transaction
        given = given or [container.new_id() for _ in range(n)]
        net_slots = net.prepare_clones(cfg, store, given, Policy.from_dict(snap.net_policy or {}))
    # n == 1 runs in this thread: a thread started per restore costs ~3 ms on a busy host
    pool = ThreadPoolExecutor(max_workers=min(n, RESTORE_CONCURRENCY)) if n > 1 else None
    futures: list[Future[WorkspaceRecord]] = []
    made: list[WorkspaceRecord] = []  # what this thread restored
    one = functools.partial(restore_boost.in_thread, _restore_one, cfg, store, snap, layout, keep_logs)

    def into(i: int) -> tuple[str | None, Slot | None]:
        return (given[i], net_slots.get(given[i])) if given else (None, None)

    # every restored process alive at the end, or the batch fails
    watch = restore_check.Watch().start(thread=pool is not None)
    try:
        if pool is None:
            with _sigint_deferred():  # never cut midway: rolled back whole, as a pool's restore is awaited
                made.append(one(*into(0), ready))
        else:
            for i in range(n):  # one by one: an interrupt mid-way still sees every submitted future
                futures.append(pool.submit(one, *into(i)))
        done = made + [fut.result() for fut in futures]
        checked = restore_check.check(Path(snap.images), [(r.id, r.pid or 0) for r in done], watch)
        with store.transaction():  # the batch is in: the clones are the caller's now
            done = [store.update_workspace(rec.id, _committed(checked)) or _committed(checked)(rec) for rec in done]
        if pool is not None:
            pool.shutdown()
        return done
    except BaseException as exc:
        _roll_back(cfg, store, pool, futures, made)
        for ws_id in net_slots:  # those of clones never started
            net.disconnect(cfg, store, ws_id)
        limit = host_limits.explain_restore_failure(exc, n) if isinstance(exc, CriuError) else None
        if limit is not None:
            raise limit from exc
        raise
    finally:
        watch.close()


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """In the main thread: a SIGINT (Ctrl-C) that lands in the block takes effect at its end
    (Python's handler then runs: ``KeyboardInterrupt``), so what the block makes is whole
    when ``restore`` rolls it back, as a pool's restore is awaited. In any other thread
    nothing: Python runs its signal handlers in the main thread only."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield  # SIG_DFL or SIG_IGN: no Python code runs on it (SIG_DFL ends the process: gc's case)
        return
    got: list[FrameType | None] = []
    signal.signal(signal.SIGINT, lambda _signum, frame: got.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        if got:
            handler(signal.SIGINT, got[-1])


def _committed(checked: restore_check.Checked) -> Callable[[WorkspaceRecord], WorkspaceRecord]:
    """A clone of a batch that is in: no owner, the batch's check cost in its ``extra``."""
    cost = {"restore_check_ms": round(checked.ms, 2), "restore_check_tasks": checked.tasks,
            "restore_check_us_per_task": round(checked.us_per_task, 1),
            "restore_check_watch_cpu_ms": round(checked.watch_cpu_ms, 2)}
    return lambda rec: rec.replace(owner_pid=None, extra={**rec.extra, **cost})


def _roll_back(cfg: Config, store: Store, pool: ThreadPoolExecutor | None,
               futures: Sequence[Future[WorkspaceRecord]], made: Sequence[WorkspaceRecord]) -> None:
    """Cancel what has not started, wait for what runs, destroy every clone made (``made``:
    those restored in the calling thread).

    A second Ctrl-C does not cut this short: the clones would be left running.
    """
    for fut in futures:
        fut.cancel()
    while pool is not None:
        try:
            pool.shutdown(wait=True, cancel_futures=True)
            break
        except KeyboardInterrupt:
            continue
    ids = [r.id for r in made] + [f.result().id for f in futures if not f.cancelled() and f.exception() is None]
    for ws_id in ids:
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


def _free_ids(store: Store, ids: Sequence[str] | None, n: int) -> list[str] | None:
    """``ids`` checked: ``n`` distinct workspace ids, none held by a workspace record."""
    if ids is None:
        return None
    given = list(ids)
    if len(given) != n or len(set(given)) != n or not all(container.ID_RE.fullmatch(i) for i in given):
        raise InvalidArgument(f"restore of {n} workspaces given ids {given!r}",
                              hint="give one id per workspace, each like ws-0123456789ab, none twice")
    held = {r.id for r in store.list_workspaces()} & set(given)
    if held:
        raise StateConflict(f"workspace ids in use: {', '.join(sorted(held))}",
                            hint="a workspace comes back under its id only once it is removed")
    return given


@dataclasses.dataclass(frozen=True)
class Ready:
    """A clone made up to its criu run (``prepare_one``): its record (``creating``, owned
    by this process), folder, overlay, identity, cgroups, images folder and placement."""

    rec: WorkspaceRecord
    cg: WorkspaceCgroup
    images: Path
    into: criu.Placement
    prepare_ms: float  # what making it took


def prepare_one(cfg: Config, store: Store, snap: SnapshotRecord, layout: Layout, ws_id: str | None = None,
                *, ahead: bool = False) -> Ready:
    """A clone of ``snap`` made up to its criu run (``ahead``: marked :data:`MADE_AHEAD`
    until then); destroyed again if a step fails."""
    ws_id = ws_id or container.new_id()
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
        network=snap.network, extra={MADE_AHEAD: True} if ahead else {},
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
        return Ready(rec, cg, images, into, (time.perf_counter() - t0) * 1000)
    except BaseException:
        discard(cfg, store, snap, ws_id)
        raise


def discard(cfg: Config, store: Store, snap: SnapshotRecord, ws_id: str) -> None:
    """Destroy a clone of ``snap`` that is not the caller's: made in part, failed, or never taken."""
    clone_images.drop(Path(snap.images) / f"{clone_images.CLONE_PREFIX}{ws_id}")
    container.destroy(cfg, store, store.get_workspace(ws_id))


def _restore_one(cfg: Config, store: Store, snap: SnapshotRecord, layout: Layout, keep_log: bool = False,
                 ws_id: str | None = None, net_slot: Slot | None = None, ready: Ready | None = None
                 ) -> WorkspaceRecord:
    """One clone: made (or ``ready``, made ahead: ``ahead``), then criu's run into it."""
    t0 = time.perf_counter()
    if ready is None:
        ready = prepare_one(cfg, store, snap, layout, ws_id)
        ahead_ms = None
    else:
        ahead_ms = ready.prepare_ms
    rec, cg, into = ready.rec, ready.cg, ready.into
    ws_id, wdir = rec.id, cfg.paths.workspace(rec.id)
    try:
        boosted = restore_boost.boost(cg, restore_boost.factor())  # criu and the tasks it forks first
        t1 = time.perf_counter()
        run = criu.restore(
            cfg.criu, ready.images, pidfile=wdir / "pid", root=Path(rec.root),
            extra=[*_COMMON, "--network-lock", "skip", "--external", f"mnt[{SYS_EXTERNAL}]:{into.sysfs}", "--manage-cgroups=ignore",
                   *mount_externals(rec.mounts, dump=False, cfg=cfg, ids=rec.ids)],
            placement=into,
            keep_log=keep_log,  # written from inside the clone's cgroup: it would be charged to it
            log_level=4 if keep_log else cfg.restore_log_level,  # a kept log is read: every step
        )
        assert run.pid is not None
        kept = clone_images.drop(ready.images, keep=run.log if keep_log else None)
        if userns_owner.owner_of(run.pid) != rec.ids:  # never a clone whose namespace host root owns
            raise RuntimeFailure(f"the user namespace of clone {ws_id} is owned by host uid "
                                 f"{userns_owner.owner_of(run.pid)}, not its own root {rec.ids}",
                                 hint="its criu did not load bunshin's userns_owner helper: run criu through "
                                      "the wrapper make install writes, or a script that keeps LD_PRELOAD")
        if boosted:
            restore_boost.settle(cg)
        t2 = time.perf_counter()
        if into.hold_netns:  # CRIU made the clone's namespace; criu's own had the setting already (``new_netns``)
            netns_image.restored(run.pid)
        net_ms = 0.0
        if net_slot is not None:  # its own address and NAT; the parent's connections out reset
            t_net = time.perf_counter()
            net.finish_clone(net_slot, run.pid, reset=into.hold_netns)
            net_ms = (time.perf_counter() - t_net) * 1000
        pid_start = psutil.Process(run.pid).create_time()
        # what this clone's restore cost, step by step (``bench fork``): its record, folder,
        # overlay, identity and cgroups (``prepare``; made ahead: ``ahead``, off the path); the
        # criu run (spawn to exit, ``restore_ms``); the pidfile and network lock after it
        steps = {"prepare": (t1 - t0) * 1000, "criu_call": (t2 - t1) * 1000, "after": (time.perf_counter() - t2) * 1000}
        if ahead_ms is not None:
            steps["ahead"] = ahead_ms
        if net_slot is not None:
            steps["net"] = net_ms  # of "after": the clone's link (``net.finish_clone``)
        # owner_pid stays set until ``restore`` commits the whole batch; ``extra`` is replaced
        # (``MADE_AHEAD`` goes)
        started = {"state": WorkspaceState.RUNNING, "pid": run.pid, "pid_start": pid_start,
                   **({"created_at": time.time()} if ahead_ms is not None else {}),  # restored now, made before
                   "extra": {"restore_ms": round(run.duration_ms, 2),
                             "restore_steps_ms": {k: round(v, 2) for k, v in steps.items()},
                             **({"restore_log": str(kept)} if keep_log else {})}}
        return store.update_workspace(ws_id, lambda r: r.replace(**started)) or rec.replace(**started)
    except BaseException:
        discard(cfg, store, snap, ws_id)
        raise


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
