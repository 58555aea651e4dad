"""``bunshin bench runtime``: workspace create latency, exec round trip, idle memory.

Side by side in one run: exec of ``true`` through the in-workspace agent against a
plain ``nsenter`` into the same workspace's namespaces.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

from rich.progress import Progress

from .. import console as output
from ..config import Config
from ..workspace import Workspace
from .stats import summary, system_used_bytes

EXECS_PER_WORKSPACE = 10


def run(cfg: Config, n: int = 20) -> dict[str, Any]:
    created: list[Workspace] = []
    create_ms: list[float] = []
    agent_ms: list[float] = []
    nsenter_ms: list[float] = []
    try:
        used0 = system_used_bytes()
        with Progress(transient=True, console=output.err) as progress:
            task = progress.add_task("creating workspaces", total=n)
            for _ in range(n):
                t0 = time.perf_counter()
                ws = Workspace.create("host", config=cfg)
                create_ms.append((time.perf_counter() - t0) * 1000)
                created.append(ws)
                progress.advance(task)
            time.sleep(1.0)  # let start-up settle before measuring idle memory
            used_idle = system_used_bytes()
            stats = [ws.stats() for ws in created]
            task = progress.add_task("exec round trips", total=n)
            for ws in created:
                for _ in range(EXECS_PER_WORKSPACE):
                    t0 = time.perf_counter()
                    res = ws.commands.run(["true"])
                    agent_ms.append((time.perf_counter() - t0) * 1000)
                    assert res.exit_code == 0, res
                    t0 = time.perf_counter()
                    subprocess.run(
                        ["nsenter", "-t", str(ws.record.pid), "-m", "-u", "-i", "-n", "-p", "-r", "-w", "true"],
                        check=True,
                    )
                    nsenter_ms.append((time.perf_counter() - t0) * 1000)
                progress.advance(task)
    finally:
        for ws in created:
            ws.remove()
    pss = [s.memory.pss_bytes for s in stats]
    uss = [s.memory.uss_bytes for s in stats]
    cgroup = [s.memory.cgroup_bytes for s in stats]
    return {
        "workspaces": n,
        "create_ms": summary(create_ms),
        "exec_agent_ms": summary(agent_ms),
        "exec_nsenter_ms": summary(nsenter_ms),
        "idle_pss_bytes": summary(pss),
        "idle_uss_bytes": summary(uss),
        "idle_cgroup_bytes": summary(cgroup),
        "system_used_per_workspace_bytes": round((used_idle - used0) / n),
    }


def print_report(r: dict[str, Any]) -> None:
    hb = output.human_bytes
    output.print_table(
        f"bunshin bench runtime ({r['workspaces']} workspaces, host image)",
        ["METRIC", "P50", "P95", "N"],
        [
            ("create workspace (ms)", r["create_ms"]["p50"], r["create_ms"]["p95"], r["create_ms"]["n"]),
            ("exec `true` via agent (ms)", r["exec_agent_ms"]["p50"], r["exec_agent_ms"]["p95"], r["exec_agent_ms"]["n"]),
            ("exec `true` via nsenter (ms)", r["exec_nsenter_ms"]["p50"], r["exec_nsenter_ms"]["p95"], r["exec_nsenter_ms"]["n"]),
            ("idle PSS per workspace", hb(r["idle_pss_bytes"]["p50"]), hb(r["idle_pss_bytes"]["p95"]), r["workspaces"]),
            ("idle USS per workspace", hb(r["idle_uss_bytes"]["p50"]), hb(r["idle_uss_bytes"]["p95"]), r["workspaces"]),
            ("idle cgroup memory per workspace", hb(r["idle_cgroup_bytes"]["p50"]), hb(r["idle_cgroup_bytes"]["p95"]), r["workspaces"]),
            ("system-wide used per workspace", hb(r["system_used_per_workspace_bytes"]), "", r["workspaces"]),
        ],
    )
