"""The README's main job (for now): one workspace, used end to end, then removed."""

from __future__ import annotations

import time
from typing import Any

from .. import console as output
from ..config import Config
from ..workspace import Workspace


def run(cfg: Config, *, as_json: bool = False) -> int:
    steps: list[dict[str, Any]] = []

    def step(what: str, t0: float, result: str) -> None:
        steps.append({"step": what, "ms": round((time.perf_counter() - t0) * 1000, 1), "result": result})

    t0 = time.perf_counter()
    ws = Workspace.create("host", name=None, memory="1G", pids=256, config=cfg)
    step("create workspace (host image)", t0, ws.id)
    try:
        t0 = time.perf_counter()
        r = ws.exec("echo hello from $(hostname); cat /proc/1/comm; ls /proc | grep -c '^[0-9]'")
        step("exec: hostname, pid 1, visible processes", t0, " | ".join(r.stdout.split()))
        t0 = time.perf_counter()
        ws.files.write("/root/notes.txt", "written inside the workspace\n")
        step("write /root/notes.txt", t0, ws.files.read_text("/root/notes.txt").strip())
        with ws.shell() as sh:
            t0 = time.perf_counter()
            sh.run("cd /tmp && export GREETING=bonjour && counter=41")
            r2 = sh.run("counter=$((counter+1)); echo $PWD $GREETING $counter")
            step("bash session keeps cwd/env/vars", t0, r2.output.strip())
        t0 = time.perf_counter()
        st = ws.stats()
        step("stats", t0, f"{st.processes} processes, cgroup {output.human_bytes(st.memory.cgroup_bytes)}, "
                          f"PSS {output.human_bytes(st.memory.pss_bytes)}, USS {output.human_bytes(st.memory.uss_bytes)}")
    finally:
        t0 = time.perf_counter()
        ws.remove()
        step("remove workspace", t0, "clean")
    if as_json:
        output.print_json({"steps": steps})
    else:
        output.print_table("bunshin demo", ["STEP", "MS", "RESULT"], [(s["step"], s["ms"], s["result"]) for s in steps])
    return 0
