"""``bunshin bench fork``: live fork against plain CRIU restore and a cold start.

A workspace runs a Python process holding a heap of ``heap_mib`` MiB (every page
written with non-zero data) that, once a second, reads one byte of each page of a
1 MiB window (the window walks the heap) and writes one page: light work that goes on
by itself in every clone and costs the same whatever the heap (so 1,024 clones of
4 GiB leave the machine responsive). The workspace also holds a bash session (one
``bash`` tool call before the first fork), as a task root would.

First the workspace is forked once (the *first fork*: its phases reported apart:
CRIU's freezing, frozen, memory-drain and page-write times, the dump's wall time, the
rewrite into memory files, the snapshot's wall time). Then, for each size N, side by
side in one run:

- ``bunshin``: copy-on-write (one dump, memory files, N restores);
- ``copy``: plain CRIU restore of the same kind of dump (every page copied), capped
  at the number of clones that fits in half the memory available after its dump;
- ``cold``: create a workspace and rebuild the heap, a few times;
- ``untrapped`` (``modes`` with ``cow-untrapped``): the copy-on-write fork without the
  SIGSYS trap that keeps converted memory exact (``Config.memory_semantics="copy"``,
  the default before it): what the trap costs, side by side.

Per size: restore latency per clone p50/p90/p99 (criu's run, spawn to exit) and the
batch's wall time per clone, the p50 of each step of a clone's restore
(``restore_steps_ms_p50``: prepare = record, folder, overlay, identity, cgroups;
criu_call; after = pidfile, network lock), parent pause, private memory per clone (``Anonymous`` of the clone's
processes) right after the restore, after one exec and one ``bash`` tool call in every
clone, and after 5 s of light work; system-wide memory added (``MemTotal -
MemAvailable``, tmpfs memory files included), the clones' own cgroups, and the time to
remove all clones (``remove_all``). Restores run in chunks of ``CHUNK`` (progress).
Then forks of a running fork at depth 1..depth.

Result (``--json``): nested dicts. Headline numbers are those of the largest size:
``r["bunshin"]["restore_ms_p50"]``, ``r["copy"]["restore_ms_p50"]``,
``r["cold"]["start_ms_p50"]``, ``r["bunshin"]["private_bytes_per_clone"]``,
``r["bunshin"]["private_bytes_after_call"]``, ``r["bunshin"]["remove_all_ms"]``,
``r["bunshin"]["total_added_bytes"]``, ``r["parent_pause_ms"]`` (p50 over the cow
forks; CRIU's own ``frozen_time``), ``r["first_fork"]`` (its phases);
``r["sizes"]`` holds every size, ``r["depth"]`` every level.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from rich.progress import Progress, TaskID

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument, RuntimeFailure
from ..runtime.memfile import criu_images
from ..runtime.snapshot import precopy
from ..tools import ToolSet
from ..workspace import Snapshot, Workspace
from ..workspace.batch import remove_all
from .stats import percentile, summary, system_used_bytes

LIGHT_WORK_S = 5.0
COPY_MEMORY_SHARE = 0.5  # copy-mode clones may use at most this share of MemAvailable
CHUNK = 64  # clones restored per call: progress between chunks
CALL_THREADS = 4  # clones exec'd and called side by side
HEAP_PROG = r"""
import os, sys, time
heap = bytearray(int(sys.argv[1]) << 20)
pages = len(heap) >> 12
for p in range(pages):  # every page written, non-zero
    heap[p << 12] = p % 251 + 1
open("/tmp/heap.ready.tmp", "w").write(str(pages))
os.replace("/tmp/heap.ready.tmp", "/tmp/heap.ready")
window = min(pages, 256) << 12  # 1 MiB
i = 0
while True:  # light work: read one byte of each page of a 1 MiB window that walks the heap, write one page
    time.sleep(1)
    at = (i * window) % len(heap)
    s = sum(heap[at:at + window:4096])
    heap[((i * 7919) % pages) << 12] = (s + i) % 251 + 1
    i += 1
"""
TOOLS = ToolSet.default()
UNTRAPPED = "cow-untrapped"
ROW = {"cow": "bunshin", "copy": "copy", UNTRAPPED: "untrapped"}
CALL = ("bash", {"command": "echo called"})


def start_heap(cfg: Config, heap_mib: int) -> Workspace:
    """A workspace whose heap program is up and has touched every page, with a bash session."""
    ws = Workspace.create("host", memory=f"{heap_mib + 768}M", pids=256, config=cfg)
    try:
        ws.files.write("/root/heap.py", HEAP_PROG)
        ws.commands.spawn(["python3", "/root/heap.py", str(heap_mib)])
        r = ws.exec(["sh", "-c", "while [ ! -s /tmp/heap.ready ]; do sleep 0.02; done"], timeout=600)
        if r.exit_code != 0:
            raise RuntimeFailure(f"the heap program did not start: {r.stdout!s}{r.stderr!s}")
        obs = TOOLS.run_sync(ws, *CALL)
        if obs.error or obs.exit_code != 0:
            raise RuntimeFailure(f"the bash tool failed in the parent: {obs.error or obs.output}")
    except BaseException:
        ws.remove()
        raise
    return ws


def copy_cap(heap_mib: int) -> int:
    """How many copy-mode clones fit in ``COPY_MEMORY_SHARE`` of the available memory."""
    avail = psutil.virtual_memory().available  # MemAvailable
    return max(1, int(avail * COPY_MEMORY_SHARE) // ((heap_mib + 64) << 20))


def criu_stats(images: str) -> dict[str, Any]:
    """CRIU's own phase times of a dump (``stats-dump``), in ms, and its page counts."""
    try:
        d = criu_images.load(Path(images) / "stats-dump")["entries"][0]["dump"]
    except Exception:  # noqa: BLE001 (a bench reports what it can)
        return {}
    ms = {f"{k.removesuffix('_time')}_ms": round(int(d[k]) / 1000, 2)
          for k in ("freezing_time", "frozen_time", "memdump_time", "memwrite_time") if k in d}
    return {**ms, **{k: int(d[k]) for k in ("pages_scanned", "pages_written") if k in d}}


def snapshot_phases(snapshot: Snapshot, wall_ms: float) -> dict[str, Any]:
    """Where a snapshot's time went: CRIU's phases, the dump's wall time, the rewrite, and with
    ``Config.fork_precopy`` the live pre-copy's (``runtime.precopy``: per process, ``pause_ms``
    its longest stop)."""
    s = snapshot.record
    out = {"snapshot_wall_ms": round(wall_ms, 2), "pause_ms": round(s.pause_ms, 2), "dump_ms": round(s.dump_ms, 2),
           "rewrite_ms": round(s.rewrite_ms, 2), "memfile_bytes": s.memfile_bytes, "image_bytes": s.image_bytes,
           "layer_bytes": s.layer_bytes, "criu": criu_stats(s.images)}
    report = Path(s.images).parent / precopy.REPORT
    if report.is_file():
        out["precopy"] = json.loads(report.read_text())
    return out


def first_fork(parent: Workspace) -> dict[str, Any]:
    """The workspace's first fork (one clone), phase by phase."""
    t0 = time.perf_counter()
    snapshot = parent.snapshot()
    take_ms = (time.perf_counter() - t0) * 1000
    try:
        t1 = time.perf_counter()
        clones = snapshot.restore(1)
        restore_wall = (time.perf_counter() - t1) * 1000
        out = snapshot_phases(snapshot, take_ms)
        out.update(restore_ms=clones[0].record.extra.get("restore_ms"), fork_wall_ms=round(take_ms + restore_wall, 2))
        remove_all(clones)
    finally:
        snapshot.remove()
    return out


def _each(clones: Sequence[Workspace], fn: Callable[[Workspace], Any]) -> list[Any]:
    with ThreadPoolExecutor(CALL_THREADS) as pool:
        return list(pool.map(fn, clones))


def _call(ws: Workspace) -> float:
    """One exec and one ``bash`` tool call; their wall time in ms."""
    t0 = time.perf_counter()
    r = ws.exec(["true"], timeout=60)
    obs = TOOLS.run_sync(ws, *CALL)
    if r.exit_code != 0 or obs.error or "called" not in obs.output:
        raise RuntimeFailure(f"clone {ws.id} did not answer: exec {r.exit_code}, tool {obs.error or obs.output!r}")
    return (time.perf_counter() - t0) * 1000


def _anon(clones: Sequence[Workspace]) -> list[int]:
    return _each(clones, lambda c: c.stats().memory.anon_bytes)


def restore_steps(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """p50 of each step of the clones' restores (``snapshot._restore_one``: prepare,
    criu_call, after), over the clones that recorded it."""
    names = dict.fromkeys(k for r in rows for k in r)
    return {k: round(percentile([r[k] for r in rows if k in r], 50), 2) for k in names}


def restore_chunks(snapshot: Snapshot, n: int, progress: Progress, task: TaskID) -> list[Workspace]:
    """``n`` clones in chunks of ``CHUNK`` (progress after each); all or none."""
    clones: list[Workspace] = []
    try:
        while len(clones) < n:
            clones += snapshot.restore(min(CHUNK, n - len(clones)))
            progress.update(task, completed=len(clones))
    except BaseException:
        remove_all(clones)
        raise
    return clones


def measure(parent: Workspace, n: int, mode: str, progress: Progress, heap_mib: int = 0, *,
            calls: bool = False) -> dict[str, Any]:
    """Snapshot ``parent``, restore n clones from it (copy: as many as fit), measure, remove both.
    ``calls``: one exec and one ``bash`` tool call in every clone (the parent has bash).

    A fork is the same two steps in one call; taken apart here so that the system-wide
    memory the clones add can be told from what the snapshot adds.
    """
    task = progress.add_task(f"{mode} x{n}: settling", total=n)
    used0 = settled_used_bytes()
    parent_bytes = parent.stats().memory.cgroup_bytes
    progress.update(task, description=f"{mode} x{n}: snapshot")
    t0 = time.perf_counter()
    if mode == UNTRAPPED:
        untrapped = dataclasses.replace(parent.config, memory_semantics="copy")
        snapshot = Workspace.get(parent.id, config=untrapped).snapshot(mode="cow")
    else:
        snapshot = parent.snapshot(mode=mode)
    take_ms = (time.perf_counter() - t0) * 1000
    phases = snapshot_phases(snapshot, take_ms)  # now: its images go with it
    asked, n = n, (min(n, copy_cap(heap_mib)) if mode == "copy" else n)
    progress.update(task, total=n, description=f"{mode} x{n}: restoring")
    clones: list[Workspace] = []
    try:
        used_snap = settled_used_bytes()
        t1 = time.perf_counter()
        clones = restore_chunks(snapshot, n, progress, task)
        restore_wall = (time.perf_counter() - t1) * 1000
        restore = [float(c.record.extra.get("restore_ms", 0.0)) for c in clones]
        steps = restore_steps([c.record.extra.get("restore_steps_ms") or {} for c in clones])
        check_ms = [float(c.record.extra.get("restore_check_ms", 0.0)) for c in clones]  # per batch
        check_us = [float(c.record.extra.get("restore_check_us_per_task", 0.0)) for c in clones]
        watch_ms = [float(c.record.extra.get("restore_check_watch_cpu_ms", 0.0)) for c in clones]
        stats0 = _each(clones, lambda c: c.stats().memory)
        anon0 = [m.anon_bytes for m in stats0]
        used1 = system_used_bytes()
        progress.update(task, description=f"{mode} x{n}: one exec + one tool call each")
        call_ms = _each(clones, _call) if calls else []
        anon1 = _anon(clones) if calls else anon0
        used_call = system_used_bytes() if calls else used1
        progress.update(task, description=f"{mode} x{n}: {LIGHT_WORK_S:.0f} s of light work")
        time.sleep(LIGHT_WORK_S)
        anon5 = _anon(clones)
        used2 = system_used_bytes()
    finally:
        progress.update(task, description=f"{mode} x{n}: removing")
        t2 = time.perf_counter()
        remove_all(clones)
        remove_ms = (time.perf_counter() - t2) * 1000
        snapshot.remove()
    progress.remove_task(task)
    clones_bytes = sum(m.cgroup_bytes for m in stats0)
    return {
        "clones": n, "asked": asked, "capped": n < asked,
        "restore_ms": summary(restore),
        "restore_ms_p50": round(percentile(restore, 50), 2),
        "restore_ms_p90": round(percentile(restore, 90), 2),
        "restore_ms_p99": round(percentile(restore, 99), 2),
        "restore_wall_ms_per_clone": round(restore_wall / n, 2),
        "restore_steps_ms_p50": steps,
        # the restore check (every restored task alive, not stopped or hung) of each batch, and per task
        "restore_check_ms_p50": round(percentile(check_ms, 50), 2),
        "restore_check_us_per_task_p50": round(percentile(check_us, 50), 1),
        "restore_check_watch_cpu_ms_p50": round(percentile(watch_ms, 50), 2),  # the event watch's CPU, per batch
        "fork_wall_ms": round(take_ms + restore_wall, 2),
        **phases,
        "parent_pause_ms": round(snapshot.record.pause_ms, 2),
        "call_ms_p50": round(percentile(call_ms, 50), 2) if call_ms else None,
        "call_ms_p90": round(percentile(call_ms, 90), 2) if call_ms else None,
        "private_bytes_per_clone": round(statistics.fmean(anon0)),
        "private_bytes_after_call": round(statistics.fmean(anon1)),
        "private_bytes_per_clone_after_work": round(statistics.fmean(anon5)),
        # system-wide (MemTotal - MemAvailable): snapshot and clones, and the clones alone
        "total_added_bytes": used1 - used0,
        "total_added_bytes_after_call": used_call - used0,
        "total_added_bytes_after_work": used2 - used0,
        "clones_added_system_bytes": used1 - used_snap,
        # the same, added up from its parts (a cross-check that other activity on the host cannot skew)
        "accounted_bytes": snapshot.record.memfile_bytes + snapshot.record.image_bytes + clones_bytes,
        # what the clones themselves hold beyond the one shared snapshot: their cgroups (user
        # memory, upper-layer files, and kernel memory: namespaces, tasks, page tables)
        "clones_added_bytes": clones_bytes,
        "parent_bytes": parent_bytes,
        "clones_added_share_of_parent": round(clones_bytes / max(parent_bytes, 1), 4),
        "remove_all_ms": round(remove_ms, 2),
        "remove_ms_per_clone": round(remove_ms / n, 2),
    }


def settled_used_bytes(timeout: float = 20.0, tolerance: int = 4 << 20) -> int:
    """System-wide used memory once it stops moving (memory of removed clones is freed lazily)."""
    deadline = time.monotonic() + timeout
    last = system_used_bytes()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = system_used_bytes()
        if abs(now - last) < tolerance:
            return now
        last = now
    return last


def depth_chain(parent: Workspace, levels: int, progress: Progress) -> list[dict[str, Any]]:
    """Fork a fork of a fork ... of ``parent``; time and delta per level."""
    task = progress.add_task(f"forks of forks to depth {levels}", total=levels)
    chain: list[Workspace] = []
    rows = []
    try:
        src = parent
        for _ in range(levels):
            time.sleep(1.5)  # the light work writes a page or two: a delta to dump
            t0 = time.perf_counter()
            (clone,) = src.fork(1)
            wall_ms = (time.perf_counter() - t0) * 1000
            chain.append(clone)
            snap = src.last_fork
            assert snap is not None
            rows.append({
                "depth": snap.depth, "fork_wall_ms": round(wall_ms, 2), "parent_pause_ms": round(snap.pause_ms, 2),
                "dump_ms": round(snap.dump_ms, 2), "rewrite_ms": round(snap.rewrite_ms, 2),
                "restore_ms": clone.record.extra.get("restore_ms"), "image_bytes": snap.image_bytes,
                "memfile_bytes": snap.memfile_bytes, "private_bytes": clone.stats().memory.anon_bytes,
            })
            src = clone
            progress.advance(task)
    finally:
        remove_all(chain)
        progress.remove_task(task)
    return rows


def cold_starts(cfg: Config, heap_mib: int, count: int, progress: Progress) -> dict[str, Any]:
    """Create a workspace and rebuild the heap, ``count`` times one after another."""
    task = progress.add_task(f"cold starts x{count}", total=count)
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        ws = start_heap(cfg, heap_mib)
        times.append((time.perf_counter() - t0) * 1000)
        ws.remove()
        progress.advance(task)
    progress.remove_task(task)
    return {"starts": count, "start_ms": summary(times), "start_ms_p50": round(percentile(times, 50), 2),
            "start_ms_p99": round(percentile(times, 99), 2)}


def host_limits() -> dict[str, Any]:
    """What bounds the number of clones here (reported with the run)."""
    def read(path: str) -> int | None:
        try:
            return int(Path(path).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
    return {"pid_max": read("/proc/sys/kernel/pid_max"), "threads_max": read("/proc/sys/kernel/threads-max"),
            "mount_max": read("/proc/sys/fs/mount-max"), "nr_open": read("/proc/sys/fs/nr_open"),
            "max_user_namespaces": read("/proc/sys/user/max_user_namespaces"),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def run(cfg: Config, *, sizes: tuple[int, ...] = (1, 8, 32, 64), heap_mib: int = 256, cold: int = 3,
        depth: int = 8, modes: tuple[str, ...] = ("cow", "copy")) -> dict[str, Any]:
    if not sizes or min(sizes) < 1 or heap_mib < 1:
        raise InvalidArgument("sizes and the heap size must be positive", hint="e.g. --sizes 1,8 --heap-mib 64")
    if not modes or set(modes) - {"cow", "copy", UNTRAPPED}:
        raise InvalidArgument(f"unknown modes {modes!r}", hint=f"give cow, copy or {UNTRAPPED}")
    result: dict[str, Any] = {"heap_mib": heap_mib, "copy_cap": copy_cap(heap_mib), "cpus": os.cpu_count(),
                              "mem_total_bytes": psutil.virtual_memory().total, "host": host_limits(),
                              "sizes": []}
    t_run = time.perf_counter()
    with Progress(console=output.err, transient=True) as progress:
        top = progress.add_task("bench fork", total=len(sizes) * len(modes) + 3)
        progress.update(top, description=f"bench fork: starting a {heap_mib} MiB heap")
        parent = start_heap(cfg, heap_mib)
        try:
            progress.update(top, description="bench fork: first fork")
            result["first_fork"] = first_fork(parent)
            progress.advance(top)
            for n in sizes:
                row: dict[str, Any] = {"clones": n}
                for mode in modes:
                    progress.update(top, description=f"bench fork: {mode} x{n}")
                    row[ROW[mode]] = measure(parent, n, mode, progress, heap_mib,
                                                                               calls=True)
                    progress.advance(top)
                result["sizes"].append(row)
            if depth:
                result["depth"] = depth_chain(parent, depth, progress)
            progress.advance(top)
        finally:
            parent.remove()
        result["cold"] = cold_starts(cfg, heap_mib, cold, progress) if cold else {}
        progress.advance(top)
    result["duration_s"] = round(time.perf_counter() - t_run, 1)
    last = result["sizes"][-1]
    result["bunshin"], result["copy"] = last.get("bunshin", {}), last.get("copy", {})
    result["untrapped"] = last.get("untrapped", {})
    pauses = [r["bunshin"]["parent_pause_ms"] for r in result["sizes"] if "bunshin" in r]
    result["parent_pause_ms"] = round(percentile(pauses, 50), 2) if pauses else None
    return result
