"""``bunshin bench clone-memory``: what a clone owns after its first exec and first tool call.

A workspace makes one exec and one ``bash`` tool call (so its shell session exists), is
snapshotted, and ``clones`` clones are restored from it. Each clone is measured right
after the restore, after one ``exec(["true"])`` and after one ``bash`` tool call
(``echo``): per process of the clone (the agent, each session's shell, anything else),
``Anonymous`` (private anonymous memory: in a clone, pages copied on write from the
shared memory files, plus new ones), ``Pss_Anon`` and ``Private_Dirty`` (the last
also counts memory-file pages only this clone maps, so it overstates what it owns).
For the agent, the areas whose ``Anonymous`` grew most during the first exec. Then
``rounds`` more of each are timed in the clone (what the memory must not cost: call latency).

``measure_clone(clone, tools)`` measures one clone that nobody has called yet (part of
any bench that restores one); ``run`` is the report. Result (``--json``):
``r["after_tool"]["anon_bytes_p50"]`` (the headline: what a clone holds after its
first exec and tool call), ``r["fresh"]``, ``r["after_exec"]`` likewise,
``r["clones"]``: every clone's stages, processes and the agent's written areas;
``r["latency_ms"]``: p50 of the timed exec and tool calls over all clones;
``r["agent_python"]``: the version of the agent's Python (``agent_bundle.agent_python``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import console as output
from ..agent.jobs import CALLS
from ..config import Config
from ..errors import InvalidArgument
from ..runtime.agent_host.bundle import CALLS_ENV, agent_calls, agent_python
from ..runtime.container.cgroups import WorkspaceCgroup
from ..tools import ToolSet
from ..workspace import Workspace

STAGES = ("fresh", "after_exec", "after_tool")
TOP_AREAS = 8
ROUNDS = 20  # timed exec and tool calls per clone, after its memory is measured


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    role: str  # "agent", "holder", "shell", "worker", "job" or "other" (see _role)
    anon_bytes: int
    pss_anon_bytes: int
    private_dirty_bytes: int
    threads: int = 1  # a thread the agent started in the clone shows here (its stack, arena)


@dataclass(frozen=True)
class Area:
    start: str  # hex address range start-end
    path: str  # the mapped file (a memory file for converted memory), "" for anonymous
    size_bytes: int
    grew_bytes: int  # Anonymous added during the measured call


@dataclass(frozen=True)
class Stage:
    name: str
    anon_bytes: int  # sum over the clone's processes
    processes: tuple[ProcessMemory, ...]


@dataclass(frozen=True)
class CloneMemory:
    stages: tuple[Stage, ...]
    agent_areas_exec: tuple[Area, ...]  # the agent's areas that grew most in the first exec
    holder_areas_tool: tuple[Area, ...] = ()  # the session holder's, in the first tool call
    exec_ms: tuple[float, ...] = ()  # each timed exec(["true"]) after the measured ones
    tool_ms: tuple[float, ...] = ()  # each timed bash tool call (``true``)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _kib_fields(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) << 10
    return out


#: ``/proc/PID/comm`` of the agent's helpers (``bunshin/agent/forks.py``): a session's
#: holder lives as long as the session; the others end with the call they serve.
HELPERS = {"bunshin-session": "holder", "bunshin-worker": "worker", "bunshin-job": "job"}
TRANSIENT = frozenset({"worker", "job", "exiting"})
SETTLE_S = 5.0


def _role(pid: int) -> str:
    """agent, holder (a session's process), shell (the shell of a session), worker / job
    (an agent helper serving one call), or other."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "other"
    if comm in HELPERS:  # first: an exiting helper's cmdline cannot be read any more
        return HELPERS[comm]
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if b"bunshin_agent" in argv:
        return "agent"
    if argv and argv[0].endswith((b"bash", b"sh")) and b"--noediting" in argv:
        return "shell"
    return "other"


def processes(ws: Workspace) -> tuple[ProcessMemory, ...]:
    """Private memory of every process of ``ws`` now (``/proc/PID/smaps_rollup``)."""
    rows = []
    for pid in WorkspaceCgroup.of_record(ws.record).pids():
        role = _role(pid)  # first: a helper that is exiting has its name still
        try:
            r = _kib_fields(f"/proc/{pid}/smaps_rollup")
            if _role(pid) != role or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                role = "exiting"  # counted as transient: measured again once it is gone
        except (OSError, IndexError):
            continue  # exited meanwhile
        rows.append(ProcessMemory(pid, role, r.get("Anonymous", 0), r.get("Pss_Anon", 0),
                                  r.get("Private_Dirty", 0), _threads(pid)))
    return tuple(sorted(rows, key=lambda p: p.pid))


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _areas(pid: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(range, path) -> (size, Anonymous) of every mapping of ``pid``."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    key, size = None, 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                key, size = (parts[0], parts[5] if len(parts) > 5 else ""), 0
            elif key is not None and len(parts) == 3 and parts[0] == "Size:":
                size = int(parts[1]) << 10
            elif key is not None and len(parts) == 3 and parts[0] == "Anonymous:":
                out[key] = (size, int(parts[1]) << 10)
    return out


def _grown(before: dict[tuple[str, str], tuple[int, int]], after: dict[tuple[str, str], tuple[int, int]]) -> tuple[Area, ...]:
    rows = [Area(k[0], k[1], size, anon - before.get(k, (0, 0))[1]) for k, (size, anon) in after.items()]
    rows = [a for a in rows if a.grew_bytes > 0]
    return tuple(sorted(rows, key=lambda a: -a.grew_bytes)[:TOP_AREAS])


def _stage(name: str, ws: Workspace) -> Stage:
    """The clone's processes once the helpers of the last call have ended (they exit
    right after answering: measured before that, they would count what dies with them)."""
    deadline = time.monotonic() + SETTLE_S
    procs = processes(ws)
    while any(p.role in TRANSIENT for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
        procs = processes(ws)
    return Stage(name, sum(p.anon_bytes for p in procs), procs)


def measure_clone(clone: Workspace, tools: ToolSet | None = None, rounds: int = 0) -> CloneMemory:
    """Measure a clone nobody has called yet: fresh, after one exec, after one bash tool call;
    then time ``rounds`` execs and ``rounds`` tool calls in it."""
    tools = tools or ToolSet.default()
    fresh = _stage("fresh", clone)
    agent = next((p.pid for p in fresh.processes if p.role == "agent"), None)
    holder = next((p.pid for p in fresh.processes if p.role == "holder"), None)
    before = _areas(agent) if agent is not None else {}
    r = clone.exec(["true"])
    if r.exit_code != 0:
        raise InvalidArgument(f"exec in the clone failed: {r.stderr!s}", hint="check the workspace with bunshin exec")
    after_exec = _stage("after_exec", clone)
    grown = _grown(before, _areas(agent)) if agent is not None else ()
    before_tool = _areas(holder) if holder is not None else {}
    obs = tools.run_sync(clone, "bash", {"command": "echo clone-memory"})
    if obs.error or obs.exit_code != 0:
        raise InvalidArgument(f"the bash tool call in the clone failed: {obs.error or obs.output}",
                              hint="check the workspace's session with bunshin exec")
    after_tool = _stage("after_tool", clone)
    holder_grown = _grown(before_tool, _areas(holder)) if holder is not None else ()
    exec_ms = tuple(_timed(lambda: clone.exec(["true"])) for _ in range(rounds))
    tool_ms = tuple(_timed(lambda: tools.run_sync(clone, "bash", {"command": "true"})) for _ in range(rounds))
    return CloneMemory((fresh, after_exec, after_tool), grown, holder_grown, exec_ms, tool_ms)


def _timed(call: Any) -> float:
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1000.0


def _summary(values: list[int]) -> dict[str, int]:
    return {"anon_bytes_p50": round(statistics.median(values)), "anon_bytes_max": max(values)}


def _by_role(stages: list[Stage]) -> dict[str, int]:
    """p50 over the clones of each role's ``Anonymous`` (summed over its processes)."""
    roles = sorted({p.role for st in stages for p in st.processes})
    return {role: round(statistics.median(sum(p.anon_bytes for p in st.processes if p.role == role)
                                          for st in stages)) for role in roles}


def run_calls(cfg: Config, *, clones: int = 3, calls: Sequence[str] = CALLS, rounds: int = ROUNDS) -> dict[str, Any]:
    """``run`` once per way the agent serves calls (``calls``), one after another:
    ``r["by_calls"][mode]`` is each run's result."""
    bad = [c for c in calls if c not in CALLS]
    if bad or not calls:
        raise InvalidArgument(f"calls must be among {', '.join(CALLS)}, not {', '.join(bad) or 'none'}",
                              hint="pass --calls thread, --calls fork or --calls thread,fork")
    if clones < 1:
        raise InvalidArgument(f"clones must be at least 1, not {clones}", hint="pass --clones 1 or more")
    return {"by_calls": {mode: run(cfg, clones=clones, calls=mode, rounds=rounds) for mode in calls}}


def run(cfg: Config, *, clones: int = 3, calls: str | None = None, rounds: int = ROUNDS) -> dict[str, Any]:
    """Snapshot a called workspace, restore ``clones`` clones one at a time, measure each.
    ``calls``: how its agent serves calls (``--calls``; ``None``: as ``$BUNSHIN_AGENT_CALLS``)."""
    if clones < 1:
        raise InvalidArgument(f"clones must be at least 1, not {clones}", hint="pass --clones 1 or more")
    if rounds < 0:
        raise InvalidArgument(f"rounds must be 0 or more, not {rounds}", hint="pass --rounds 20 (0: no timing)")
    with _agent_calls(calls):
        result = _run(cfg, clones, rounds)
    result["calls"] = agent_calls() if calls is None else calls
    return result


@contextmanager
def _agent_calls(calls: str | None) -> Iterator[None]:
    """Agents started inside serve calls this way (the launcher reads ``$BUNSHIN_AGENT_CALLS``)."""
    if calls is None:
        yield
        return
    old = os.environ.get(CALLS_ENV)
    os.environ[CALLS_ENV] = calls
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CALLS_ENV, None)
        else:
            os.environ[CALLS_ENV] = old


def _run(cfg: Config, clones: int, rounds: int) -> dict[str, Any]:
    tools = ToolSet.default()
    started = time.monotonic()
    parent = Workspace.create("host", config=cfg)
    try:
        parent.exec(["true"])
        tools.run_sync(parent, "bash", {"command": "echo parent"})
        parent_procs = processes(parent)
        snap = parent.snapshot()
        try:
            measured = []
            for _ in range(clones):
                (clone,) = snap.restore(1)
                try:
                    measured.append(measure_clone(clone, tools, rounds))
                finally:
                    clone.remove()
        finally:
            snap.remove()
    finally:
        parent.remove()
    result: dict[str, Any] = {name: _summary([m.stage(name).anon_bytes for m in measured]) for name in STAGES}
    result["roles"] = {name: _by_role([m.stage(name) for m in measured]) for name in STAGES}
    result["parent"] = {"anon_bytes": sum(p.anon_bytes for p in parent_procs), "processes": parent_procs}
    result["clones"] = measured
    result["goal_bytes"] = 1 << 20
    exec_ms = [t for m in measured for t in m.exec_ms]
    tool_ms = [t for m in measured for t in m.tool_ms]
    result["latency_ms"] = {"exec_p50": round(statistics.median(exec_ms), 2) if exec_ms else None,
                            "tool_p50": round(statistics.median(tool_ms), 2) if tool_ms else None,
                            "rounds": rounds}
    result["agent_python"] = agent_python().version
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


def print_report(r: dict[str, Any]) -> None:
    def kib(n: int) -> str:
        return f"{n / 1024:.0f} KiB"

    rows = [(name, kib(r[name]["anon_bytes_p50"]), kib(r[name]["anon_bytes_max"])) for name in STAGES]
    lat = r["latency_ms"]
    output.print_table(f"--calls {r['calls']}, agent Python {r['agent_python']}: private memory per clone "
                       f"(parent: {kib(r['parent']['anon_bytes'])}; goal <= 1 MiB after a tool call); "
                       f"p50 of {lat['rounds']} calls more: exec {lat['exec_p50']} ms, tool call {lat['tool_p50']} ms",
                       ["stage", "p50", "max"], rows)
    roles = sorted({role for name in STAGES for role in r["roles"][name]})
    output.print_table("p50 per role", ["stage", *roles],
                       [(name, *(kib(r["roles"][name].get(role, 0)) for role in roles)) for name in STAGES])
    first: CloneMemory = r["clones"][0]
    procs = [(s.name, p.role, p.pid, p.threads, kib(p.anon_bytes), kib(p.pss_anon_bytes), kib(p.private_dirty_bytes))
             for s in first.stages for p in s.processes]
    output.print_table("first clone, per process", ["stage", "role", "pid", "threads", "Anonymous", "Pss_Anon",
                                                    "Private_Dirty"], procs)
    output.print_table("first clone: the agent's areas written by its first exec",
                       ["area", "file", "size", "grew"],
                       [(a.start, a.path.rsplit("/", 1)[-1], kib(a.size_bytes), kib(a.grew_bytes)) for a in first.agent_areas_exec])
    output.print_table("first clone: the session holder's areas written by the first tool call",
                       ["area", "file", "size", "grew"],
                       [(a.start, a.path.rsplit("/", 1)[-1], kib(a.size_bytes), kib(a.grew_bytes)) for a in first.holder_areas_tool])
