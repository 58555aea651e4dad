"""``bunshin bench fork``: live fork against plain CRIU restore and a cold start.

A workspace runs a Python process holding a heap of ``heap_mib`` MiB (every page
written with non-zero data) that, once a second, reads one byte of every page
and writes one page: light work that goes on by itself in every clone. It is
forked 1, 8, 32, 64 times, side by side in one run:

- ``bunshin``: copy-on-write fork (one dump, memory files, N restores);
- ``copy``: plain CRIU restore of the same kind of dump (every page copied), capped
  at the number of clones that fits in half the available memory (reported);
- ``cold``: create a workspace and rebuild the heap, a few times.

Per size: restore latency p50/p99, parent pause, private memory per clone right
after the restore and after 5 s of light work (``Anonymous`` of the clone's
processes), and system-wide memory added by all clones (``MemTotal -
MemAvailable``, tmpfs memory files included; the baseline is taken once the
memory of the previous round's clones is freed; ``accounted_bytes`` adds the same
up from memory files, images and the clones' cgroups). Then forks of a running fork at
depth 1..8 (times and delta sizes per level).

Result (``--json``): nested dicts. Headline numbers are those of the largest
size: ``r["bunshin"]["restore_ms_p50"]``, ``r["copy"]["restore_ms_p50"]``,
``r["cold"]["start_ms_p50"]``, ``r["bunshin"]["private_bytes_per_clone"]``,
``r["copy"]["private_bytes_per_clone"]``, ``r["bunshin"]["total_added_bytes"]``,
``r["copy"]["total_added_bytes"]``, ``r["parent_pause_ms"]`` (p50 over the cow
forks; CRIU's own ``frozen_time``); ``r["bunshin"]["clones_added_bytes"]`` (the
clones' cgroups, without the shared snapshot) and its share of the parent's
cgroup, ``clones_added_share_of_parent``; ``r["sizes"]`` holds every size,
``r["depth"]`` every level.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import psutil
from rich.progress import Progress

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument, RuntimeFailure
from ..workspace import Workspace
from .stats import percentile, summary, system_used_bytes

LIGHT_WORK_S = 5.0
COPY_MEMORY_SHARE = 0.5  # copy-mode clones may use at most this share of MemAvailable
HEAP_PROG = r"""
import os, sys, time
heap = bytearray(int(sys.argv[1]) << 20)
pages = len(heap) >> 12
for p in range(pages):  # every page written, non-zero
    heap[p << 12] = p % 251 + 1
open("/tmp/heap.ready.tmp", "w").write(str(pages))
os.replace("/tmp/heap.ready.tmp", "/tmp/heap.ready")
i = 0
while True:  # light work: read one byte of every page, write one page, every second
    time.sleep(1)
    s = sum(heap[::4096])
    heap[((i * 7919) % pages) << 12] = (s + i) % 251 + 1
    i += 1
"""


def start_heap(cfg: Config, heap_mib: int) -> Workspace:
    """A workspace whose heap program is up and has touched every page."""
    ws = Workspace.create("host", memory=f"{heap_mib + 768}M", pids=256, config=cfg)
    try:
        ws.files.write("/root/heap.py", HEAP_PROG)
        ws.commands.spawn(["python3", "/root/heap.py", str(heap_mib)])
        r = ws.exec(["sh", "-c", "while [ ! -s /tmp/heap.ready ]; do sleep 0.02; done"], timeout=300)
        if r.exit_code != 0:
            raise RuntimeFailure(f"the heap program did not start: {r.stdout!s}{r.stderr!s}")
    except BaseException:
        ws.remove()
        raise
    return ws


def copy_cap(heap_mib: int) -> int:
    """How many copy-mode clones fit in ``COPY_MEMORY_SHARE`` of the available memory."""
    avail = psutil.virtual_memory().available  # MemAvailable
    return max(1, int(avail * COPY_MEMORY_SHARE) // ((heap_mib + 64) << 20))


def measure(parent: Workspace, n: int, mode: str, progress: Progress) -> dict[str, Any]:
    """Snapshot ``parent``, restore n clones from it, measure, remove both.

    A fork is the same two steps in one call; taken apart here so that the system-wide
    memory the clones add can be told from what the snapshot adds.
    """
    task = progress.add_task(f"{mode} fork x{n}: settling", total=n + 3)
    used0 = settled_used_bytes()
    parent_bytes = parent.stats().memory.cgroup_bytes
    progress.update(task, description=f"{mode} fork x{n}")
    t0 = time.perf_counter()
    snapshot = parent.snapshot(mode=mode)
    take_ms = (time.perf_counter() - t0) * 1000
    snap = snapshot.record
    clones: list[Workspace] = []
    try:
        used_snap = settled_used_bytes()
        t1 = time.perf_counter()
        clones = snapshot.restore(n)
        wall_ms = take_ms + (time.perf_counter() - t1) * 1000
        progress.advance(task)
        restore = [float(c.record.extra.get("restore_ms", 0.0)) for c in clones]
        stats0 = [c.stats().memory for c in clones]
        anon0 = [m.anon_bytes for m in stats0]
        used1 = system_used_bytes()
        progress.update(task, description=f"{mode} fork x{n}: {LIGHT_WORK_S:.0f} s of light work")
        time.sleep(LIGHT_WORK_S)
        progress.advance(task)
        anon5 = [c.stats().memory.anon_bytes for c in clones]
        used2 = system_used_bytes()
        progress.advance(task)
    finally:
        progress.update(task, description=f"{mode} fork x{n}: removing clones")
        for c in clones:
            c.remove()
            progress.advance(task)
        snapshot.remove()
    progress.remove_task(task)
    clones_bytes = sum(m.cgroup_bytes for m in stats0)
    return {
        "clones": n,
        "restore_ms": summary(restore),
        "restore_ms_p50": round(percentile(restore, 50), 2),
        "restore_ms_p99": round(percentile(restore, 99), 2),
        "fork_wall_ms": round(wall_ms, 2),
        "parent_pause_ms": round(snap.pause_ms, 2),
        "dump_ms": round(snap.dump_ms, 2),
        "rewrite_ms": round(snap.rewrite_ms, 2),
        "memfile_bytes": snap.memfile_bytes,
        "image_bytes": snap.image_bytes,
        "private_bytes_per_clone": round(statistics.fmean(anon0)),
        "private_bytes_per_clone_after_work": round(statistics.fmean(anon5)),
        # system-wide (MemTotal - MemAvailable): snapshot and clones, and the clones alone
        "total_added_bytes": used1 - used0,
        "total_added_bytes_after_work": used2 - used0,
        "clones_added_system_bytes": used1 - used_snap,
        # the same, added up from its parts (a cross-check that other activity on the host cannot skew)
        "accounted_bytes": snap.memfile_bytes + snap.image_bytes + clones_bytes,
        # what the clones themselves hold beyond the one shared snapshot: their cgroups (user
        # memory, upper-layer files, and kernel memory: namespaces, tasks, page tables)
        "clones_added_bytes": clones_bytes,
        "parent_bytes": parent_bytes,
        "clones_added_share_of_parent": round(clones_bytes / max(parent_bytes, 1), 4),
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
        for c in reversed(chain):
            c.remove()
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


def run(cfg: Config, *, sizes: tuple[int, ...] = (1, 8, 32, 64), heap_mib: int = 256, cold: int = 3,
        depth: int = 8) -> dict[str, Any]:
    if not sizes or min(sizes) < 1 or heap_mib < 1:
        raise InvalidArgument("sizes and the heap size must be positive", hint="e.g. --sizes 1,8 --heap-mib 64")
    cap = copy_cap(heap_mib)
    result: dict[str, Any] = {"heap_mib": heap_mib, "copy_cap": cap, "cpus": os.cpu_count(),
                              "mem_total_bytes": psutil.virtual_memory().total, "sizes": []}
    with Progress(console=output.err, transient=True) as progress:
        top = progress.add_task("bench fork", total=len(sizes) * 2 + 2)
        parent = start_heap(cfg, heap_mib)
        try:
            for c in parent.fork(1):  # warm-up: one-time costs (CRIU's own start-up) stay out
                c.remove()
            for n in sizes:
                row: dict[str, Any] = {"clones": n, "bunshin": measure(parent, n, "cow", progress)}
                progress.advance(top)
                row["copy"] = measure(parent, min(n, cap), "copy", progress)
                row["copy"]["capped"] = n > cap
                result["sizes"].append(row)
                progress.advance(top)
            result["depth"] = depth_chain(parent, depth, progress)
            progress.advance(top)
        finally:
            parent.remove()
        result["cold"] = cold_starts(cfg, heap_mib, cold, progress)
        progress.advance(top)
    last = result["sizes"][-1]
    result["bunshin"], result["copy"] = last["bunshin"], last["copy"]
    result["parent_pause_ms"] = round(percentile([r["bunshin"]["parent_pause_ms"] for r in result["sizes"]], 50), 2)
    return result


def print_report(r: dict[str, Any]) -> None:
    hb = output.human_bytes
    rows = []
    for size in r["sizes"]:
        for mode in ("bunshin", "copy"):
            m = size[mode]
            n = f"{m['clones']}" + (f" (of {size['clones']}: capped)" if m.get("capped") else "")
            rows.append((mode, n, m["restore_ms_p50"], m["restore_ms_p99"], m["parent_pause_ms"],
                         hb(m["private_bytes_per_clone"]), hb(m["private_bytes_per_clone_after_work"]),
                         hb(m["total_added_bytes"]), hb(m["accounted_bytes"]), hb(m["memfile_bytes"]),
                         f"{hb(m['clones_added_bytes'])} ({m['clones_added_share_of_parent']:.0%})"))
    c = r["cold"]
    rows.append(("cold start", c["starts"], c["start_ms_p50"], c["start_ms_p99"], "", "", "", "", "", "", ""))
    output.print_table(
        f"bunshin bench fork: {r['heap_mib']} MiB heap, {r['cpus']} CPUs, {hb(r['mem_total_bytes'])} RAM "
        f"(copy mode capped at {r['copy_cap']} clones: half the available memory)",
        ["MODE", "CLONES", "RESTORE P50 MS", "P99 MS", "PARENT PAUSE MS", "PRIVATE/CLONE",
         f"AFTER {LIGHT_WORK_S:.0f} S", "SYSTEM ADDED", "ACCOUNTED", "MEMORY FILES", "CLONES' CGROUPS (OF PARENT)"],
        rows,
    )
    output.print_table(
        "forks of a running fork",
        ["DEPTH", "PAUSE MS", "DUMP MS", "REWRITE MS", "RESTORE MS", "IMAGE (DELTA)", "NEW MEMORY FILES",
         "CLONE PRIVATE"],
        [(d["depth"], d["parent_pause_ms"], d["dump_ms"], d["rewrite_ms"], d["restore_ms"], hb(d["image_bytes"]),
          hb(d["memfile_bytes"]), hb(d["private_bytes"])) for d in r.get("depth", [])],
    )
