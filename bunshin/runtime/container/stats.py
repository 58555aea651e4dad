"""Memory, CPU and process accounting of one workspace: cgroup usage plus PSS/USS of its processes."""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from ..state.records import WorkspaceRecord
from .cgroups import WorkspaceCgroup


@dataclass(frozen=True)
class MemoryStats:
    cgroup_bytes: int  # what the workspace's memory cgroup charges (includes its tmpfs pages)
    pss_bytes: int  # sum of proportional set sizes of its processes
    uss_bytes: int  # sum of memory unique to its processes
    anon_bytes: int  # sum of private anonymous memory (what a clone really owns)


@dataclass(frozen=True)
class WorkspaceStats:
    id: str
    memory: MemoryStats
    processes: int
    cpu_s: float = 0.0  # CPU seconds used by the whole workspace so far (its cgroup's count)


def collect(rec: WorkspaceRecord) -> WorkspaceStats:
    cg = WorkspaceCgroup.of_record(rec)
    pids = cg.pids()
    pss = uss = anon = 0
    for pid in pids:
        try:
            rollup = _smaps_rollup(pid)
        except (OSError, psutil.Error):
            continue
        pss += rollup.get("Pss", 0)
        uss += rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)
        anon += rollup.get("Anonymous", 0)
    return WorkspaceStats(
        id=rec.id,
        memory=MemoryStats(cgroup_bytes=cg.memory_bytes(), pss_bytes=pss, uss_bytes=uss, anon_bytes=anon),
        processes=len(pids),
        cpu_s=cg.cpu_seconds(),
    )


def _smaps_rollup(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out
