"""``bunshin bench fork --mode precopy``: the fork with and without live pre-copy, side by side in one run.

For each side (``Config.fork_precopy`` off, then on) a fresh workspace holding a
``heap_mib`` heap (``fork.start_heap``) is forked once (the first fork, phase by
phase: with pre-copy, ``runtime.precopy``'s pre-copy while it runs, stop, dirty
copy, remap (trap included) and copy for the clones, per converted process;
then CRIU's dump, a delta), then once per size N (``fork.measure``: later rounds'
pause, restore latency, memory). ``memory_held_bytes``: system-wide memory
(``MemTotal - MemAvailable``) the parent holds after its first fork, the
snapshot removed, against before it started.
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
            side_cfg = dataclasses.replace(cfg, fork_precopy=on)
            used0 = fork.settled_used_bytes()
            progress.update(top, description=f"precopy {name}: starting a {heap_mib} MiB heap")
            parent = fork.start_heap(side_cfg, heap_mib)
            try:
                used_parent = fork.settled_used_bytes()
                progress.update(top, description=f"precopy {name}: first fork")
                side: dict[str, Any] = {"first_fork": first_fork(parent)}
                side["memory_held_bytes"] = fork.settled_used_bytes() - used0
                side["memory_before_fork_bytes"] = used_parent - used0
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
