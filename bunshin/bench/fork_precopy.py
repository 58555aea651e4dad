"""``bunshin bench fork --mode precopy``: the fork with and without live pre-copy, side by side in one run.

For each side (``Config.fork_precopy`` off, then on) a fresh workspace holding a
``heap_mib`` heap (``fork.start_heap``) is forked once (the first fork, phase by
phase: with pre-copy, ``runtime.precopy``'s pre-copy while it runs, stop, dirty
copy, remap (trap included) and copy for the clones, per converted process;
then CRIU's dump, a delta), then once per size N (``fork.measure``: later rounds'
pause, restore latency, memory). ``memory_held_bytes``: system-wide memory
(``MemTotal - MemAvailable``) the parent holds after its first fork, the
snapshot removed, against before it started; ``parent_anon_bytes`` before and after
the first fork (the workspace's own anonymous memory: with pre-copy, what went into
the live files, ``live_file_bytes``, which the clones map too: one copy).
``first_fork.phases``: the first fork's wall time per phase, in order (pre-copy
passes, the bind, the stops, CRIU's dump and its frozen time, the rewrite, the
rest of the snapshot, the first restore) and ``usable_ms`` (the call, to a
restored clone running).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from rich.progress import Progress

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..workspace import Workspace
from ..workspace.batch import remove_all
from . import fork


def phases(out: dict[str, Any]) -> dict[str, float]:
    """The first fork's wall time per phase (ms), from ``first_fork``'s record."""
    conv = out.get("precopy", {}).get("converted", [])
    wall = out.get("precopy", {}).get("wall_ms", 0.0)
    ph: dict[str, float] = {}
    passes = [sum(c.get("pass_ms", [])[i] for c in conv if len(c.get("pass_ms", [])) > i)
              for i in range(max((len(c.get("pass_ms", [])) for c in conv), default=0))]
    for i, ms in enumerate(passes):
        ph[f"precopy_pass_{i + 1}_ms"] = round(ms, 2)
    if conv:
        ph["bind_ms"] = round(sum(c.get("publish_ms", 0.0) for c in conv), 2)
        ph["stops_ms"] = round(sum(c["stopped_ms"] for c in conv), 2)
        ph["stops"] = sum(c["stops"] for c in conv)
        ph["longest_stop_ms"] = round(max(c["pause_ms"] for c in conv), 2)
    if wall:
        ph["precopy_wall_ms"] = round(wall, 2)
        ph["precopy_cpu_boost"] = out.get("precopy", {}).get("cpu_boost", 1)
    ph["criu_dump_ms"] = out["dump_ms"]
    ph["criu_frozen_ms"] = out.get("criu", {}).get("frozen_ms", out["pause_ms"])
    ph["rewrite_ms"] = out["rewrite_ms"]
    ph["snapshot_other_ms"] = round(out["snapshot_wall_ms"] - wall - out["dump_ms"] - out["rewrite_ms"], 2)
    ph["first_restore_ms"] = round(out["usable_ms"] - out["snapshot_wall_ms"], 2)
    ph["usable_ms"] = out["usable_ms"]
    return ph


def _anon_bytes(ws: Workspace) -> int:
    return int(ws.stats().memory.anon_bytes)


def _live_file_bytes(out: dict[str, Any]) -> int:
    total = 0
    for c in out.get("precopy", {}).get("converted", []):
        try:
            total += os.stat(c["path"], follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total


def first_fork(parent: Workspace) -> dict[str, Any]:
    """The first fork (one clone), with the pre-copy's phases if there was one."""
    t0 = time.perf_counter()
    snapshot = parent.snapshot()
    take_ms = (time.perf_counter() - t0) * 1000
    try:
        out = fork.snapshot_phases(snapshot, take_ms)
        if "precopy" in out:
            out["criu_pause_ms"] = round(snapshot.record.pause_ms - out["precopy"]["pause_ms"], 2)
        t1 = time.perf_counter()
        clones = snapshot.restore(1)
        out["restore_ms"] = clones[0].record.extra.get("restore_ms")
        out["usable_ms"] = round(take_ms + (time.perf_counter() - t1) * 1000, 2)  # call to a running clone
        out["phases"] = phases(out)
        remove_all(clones)
    finally:
        snapshot.remove()
    return out


def run(cfg: Config, *, heap_mib: int, sizes: tuple[int, ...] = (1,)) -> dict[str, Any]:
    if heap_mib < 1 or not sizes or min(sizes) < 1:
        raise InvalidArgument("sizes and the heap size must be positive", hint="e.g. --sizes 1,8 --heap-mib 64")
    result: dict[str, Any] = {"heap_mib": heap_mib, "cpus": os.cpu_count(), "host": fork.host_limits(), "sides": {}}
    with Progress(console=output.err, transient=True) as progress:
        top = progress.add_task("bench fork precopy", total=2 * (len(sizes) + 1))
        for name, on in (("off", False), ("on", True)):
            side_cfg = dataclasses.replace(cfg, fork_precopy=on, fork_precopy_min_mib=0)  # the heap, whatever its size
            used0 = fork.settled_used_bytes()
            progress.update(top, description=f"precopy {name}: starting a {heap_mib} MiB heap")
            parent = fork.start_heap(side_cfg, heap_mib)
            try:
                used_parent = fork.settled_used_bytes()
                anon0 = _anon_bytes(parent)
                progress.update(top, description=f"precopy {name}: first fork")
                side: dict[str, Any] = {"first_fork": first_fork(parent)}
                side["memory_held_bytes"] = fork.settled_used_bytes() - used0
                side["memory_before_fork_bytes"] = used_parent - used0
                side["parent_anon_bytes"] = {"before": anon0, "after": _anon_bytes(parent)}
                side["live_file_bytes"] = _live_file_bytes(side["first_fork"])
                progress.advance(top)
                side["sizes"] = []
                for n in sizes:
                    progress.update(top, description=f"precopy {name}: fork x{n}")
                    side["sizes"].append(fork.measure(parent, n, "cow", progress, heap_mib, calls=True))
                    progress.advance(top)
            finally:
                parent.remove()
            result["sides"][name] = side
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def phase_table(result: dict[str, Any]) -> tuple[str, list[str], list[list[Any]]]:
    """The first fork's phases side by side (title, headers, rows) for ``console.print_table``."""
    sides = list(result["sides"])
    keys: list[str] = []
    for side in sides:
        keys += [k for k in result["sides"][side]["first_fork"]["phases"] if k not in keys]
    rows = [[k, *(result["sides"][s]["first_fork"]["phases"].get(k, "") for s in sides)] for k in keys]
    for label, get in (("parent anon before / after (MiB)", lambda v: "{} / {}".format(
            v["parent_anon_bytes"]["before"] >> 20, v["parent_anon_bytes"]["after"] >> 20)),
            ("live files (MiB)", lambda v: v["live_file_bytes"] >> 20),
            ("system memory held after (MiB)", lambda v: v["memory_held_bytes"] >> 20)):
        rows.append([label, *(get(result["sides"][s]) for s in sides)])
    return f"first fork of a {result['heap_mib']} MiB heap, pre-copy off and on (ms)", ["", *sides], rows
