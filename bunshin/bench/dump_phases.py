"""Where a dump's pause goes, and ``bunshin bench delta-pause``.

``parse(log)`` splits the frozen part of one ``criu dump -v4`` log at CRIU's own
markers and adds up the time spent in each phase (a tree of several processes goes
through the per-task phases once per process; their times are summed):

- ``seize``: from the freeze to the first task: seizing the threads, collecting
  mounts, sockets (one netlink query per family) and namespaces;
- ``task``: a task's mappings (each mapped file's path is checked) and descriptors;
- ``parasite``: injecting the parasite into a task;
- ``pages``: a task's page map and pages, and the parasite's cure;
- ``tree``: namespaces, the process tree, cgroups, the image inventory;
- ``post_dump``: CRIU's ``post-dump`` notification, answered over its RPC socket once
  bunshin's copier has made the frozen copy of the upper (``runtime/upper_copy``);

until the tasks are unfrozen. ``run`` forks a running fork ``forks`` times (each a
delta: its parent is already memory-file backed) at the configured log level
(``Config.dump_log_level``: the pause a user pays) and as many times at ``-v4`` (the
markers cost ~2 ms of writes), alternated, and reports both pauses (CRIU's
``frozen_time``) and every phase of the ``-v4`` dumps, p50, p90 and max (``--json``:
``r["pause_ms_p50"]``, ``r["pause_ms_p90"]``, ``r["traced_pause_ms_p50"]``,
``r["phases_ms_p50"][name]``, ``r["rounds"]``: each round's two pauses and phases). For
the tail, each dump at the configured level also gives the pages CRIU wrote
(``pages``, its stats) and how long the dumped tasks' threads waited for a CPU while it
ran (``tasks_wait_ms``: their schedstat run-queue wait, before and after the dump; they
are idle but for CRIU's parasite, so nearly all of it falls inside the pause); each ``-v4``
dump the threads CRIU seized besides each process's main one (``threads``, at most
``r["threads_max"]``: each is dumped inside the pause; the agent's waiting ones end before
the freeze, ``runtime/agent_trim``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from .. import console as output
from ..config import Config
from ..errors import BunshinError, InvalidArgument
from ..runtime.memfile import criu_images
from ..tools import ToolSet
from ..workspace import Snapshot, Workspace

_TS = re.compile(r"^\((\d+\.\d+)\)")
#: (phase the marker starts, what the log line says); the first one starts the pause
MARKERS = (
    ("seize", re.compile(r"Detected cgroup V\d freezer|^\(\S+\)\s+Seizing ")),
    ("task", re.compile(r"Dumping task \(pid")),
    ("parasite", re.compile(r"Set up parasite blob")),
    ("pages", re.compile(r"Dumping pages \(type")),
    ("tree", re.compile(r"Dumping task cwd id|Dumping pstree")),
    ("post_dump", re.compile(r"Running post-dump scripts")),
)
PHASES = tuple(name for name, _ in MARKERS)
_END = re.compile(r"Unfreezing tasks")
_THREAD = re.compile(r"Seizing \d+'s \d+ thread")  # a thread besides its process's main one


@dataclass(frozen=True)
class DumpPhases:
    frozen_ms: float  # from the freeze to the thaw, as the log tells it
    phases_ms: dict[str, float]  # every name of PHASES, summed over the tasks
    threads: int = 0  # threads CRIU seized besides each process's main one


def parse(log: str) -> DumpPhases | None:
    """The pause of one dump per phase; None for a log without a freeze and a thaw."""
    spent = dict.fromkeys(PHASES, 0.0)
    start = phase = last = None
    threads = 0
    for line in log.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = float(m.group(1)) * 1000
        if start is not None and _END.search(line):
            assert phase is not None and last is not None
            spent[phase] += t - last
            return DumpPhases(round(t - start, 3), {k: round(v, 3) for k, v in spent.items()}, threads)
        threads += bool(_THREAD.search(line))
        for name, pattern in MARKERS:
            if not pattern.search(line) or (start is None and name != "seize") or name == phase:
                continue
            if start is None:
                start = t
            else:
                assert phase is not None and last is not None
                spent[phase] += t - last
            phase, last = name, t
            break
    return None


def of_snapshot(snap: Snapshot) -> DumpPhases | None:
    """The phases of the dump that made ``snap`` (its ``dump.log`` is kept with the images)."""
    try:
        return parse((Path(snap.record.images) / "dump.log").read_text(errors="replace"))
    except OSError:
        return None


#: ``/proc/PID/comm`` of the agent's helpers that end with the call they serve (a job that
#: is ending is a zombie leader CRIU cannot dump: ``fork_checks`` refuses the fork)
TRACE_LEVEL = 4  # CRIU's log level whose lines mark the phases
TRANSIENT = frozenset({"bunshin-worker", "bunshin-job"})
SETTLE_S = 5.0
GOAL_MS = 10.0  # issue 17's goal for a delta's pause


def _settle(ws: Workspace) -> None:
    """Wait (at most ``SETTLE_S``) until the helpers of the last call have ended."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(ws.record.pid).children(recursive=True)
            if not any(k.name() in TRANSIENT for k in kids):
                return
        except psutil.Error:
            pass  # one ended while we looked: look again
        time.sleep(0.02)


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _p90(values: list[float]) -> float:
    if len(values) < 2:
        return round(values[0], 2)
    return round(statistics.quantiles(values, n=10, method="inclusive")[8], 2)


def _threads(pid: int | None) -> list[int]:
    """Every thread of the tree of ``pid`` (host ids)."""
    out: list[int] = []
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)] if pid else []
    except psutil.Error:
        return out
    for p in procs:
        try:
            out += [int(t) for t in os.listdir(f"/proc/{p.pid}/task")]
        except OSError:
            pass  # ended: none of its threads to count
    return out


def _waited_ns(tids: list[int]) -> dict[int, int]:
    """Each thread's time spent runnable but not running (``/proc/TID/schedstat``, its second field)."""
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _pages_written(snap: Snapshot) -> int | None:
    try:
        stats = criu_images.load(Path(snap.record.images) / "stats-dump")["entries"][0]["dump"]
        return int(stats["pages_written"])
    except (OSError, BunshinError, KeyError, IndexError, TypeError, ValueError):
        return None


def run(cfg: Config, *, forks: int = 8) -> dict[str, Any]:
    """Fork a running fork ``forks`` times at the configured log level (the pause a user
    pays) and ``forks`` times at ``-v4`` (the split), alternated."""
    if forks < 1:
        raise InvalidArgument(f"forks must be at least 1, not {forks}", hint="pass --forks 1 or more")
    started, load_before = time.monotonic(), os.getloadavg()[0]
    rounds: list[dict[str, Any]] = []
    root = Workspace.create("host", config=cfg)
    try:
        root.exec(["true"])
        ToolSet.default().run_sync(root, "bash", {"command": "cd /tmp"})  # a session: its holder and a shell
        first = root.snapshot()
        try:
            (fork,) = first.restore(1)
            try:
                fork.exec(["true"])
                _settle(fork)
                traced = Workspace.get(fork.id, config=dataclasses.replace(cfg, dump_log_level=TRACE_LEVEL))
                for i in range(forks):
                    rounds.append(_round(fork, traced, traced_first=bool(i % 2)))
            finally:
                fork.remove()
        finally:
            first.remove()
    finally:
        root.remove()
    split_rounds = [r["phases_ms"] for r in rounds if r["phases_ms"] is not None]
    return {
        "forks": forks,
        "log_level": cfg.dump_log_level,
        "pause_ms_p50": _p50([r["pause_ms"] for r in rounds]),
        "pause_ms_p90": _p90([r["pause_ms"] for r in rounds]),
        "pause_ms_max": max(r["pause_ms"] for r in rounds),
        "over_goal": sum(r["pause_ms"] > GOAL_MS for r in rounds),
        "tasks_wait_ms_p50": _p50([r["tasks_wait_ms"] for r in rounds]),
        "tasks_wait_ms_p90": _p90([r["tasks_wait_ms"] for r in rounds]),
        "dump_ms_p50": _p50([r["dump_ms"] for r in rounds]),
        "traced_pause_ms_p50": _p50([r["traced_pause_ms"] for r in rounds]),
        "traced_pause_ms_p90": _p90([r["traced_pause_ms"] for r in rounds]),
        "phases_ms_p50": {k: _p50([p[k] for p in split_rounds]) for k in PHASES} if split_rounds else {},
        "phases_ms_max": {k: max(p[k] for p in split_rounds) for k in PHASES} if split_rounds else {},
        "threads_max": max((r["threads"] for r in rounds if r.get("threads") is not None), default=None),
        "goal_ms": GOAL_MS,
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # at the start and the end
        "rounds": rounds,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _round(fork: Workspace, traced: Workspace, *, traced_first: bool) -> dict[str, Any]:
    """One delta at the configured log level and one at ``-v4``, split at its markers (in
    the order given: rounds alternate it, so neither always follows the other)."""
    out: dict[str, Any] = {}
    for ws in ((traced, fork) if traced_first else (fork, traced)):
        tids = _threads(ws.record.pid) if ws is fork else []
        before = _waited_ns(tids)
        snap = ws.snapshot()
        try:
            if ws is fork:
                after = _waited_ns(tids)
                waited = sum(after[t] - before[t] for t in after if t in before)
                out.update(pause_ms=snap.record.pause_ms, dump_ms=snap.record.dump_ms, pages=_pages_written(snap),
                           tasks_wait_ms=round(waited / 1e6, 3))
            else:
                split = of_snapshot(snap)
                out.update(traced_pause_ms=snap.record.pause_ms, frozen_ms_in_log=split.frozen_ms if split else None,
                           phases_ms=split.phases_ms if split else None, threads=split.threads if split else None)
        finally:
            snap.remove()
    return out


def print_report(r: dict[str, Any]) -> None:
    rows = [(f"pause (CRIU frozen_time, -v{r['log_level']})", r["pause_ms_p50"], r["pause_ms_p90"], r["pause_ms_max"]),
            ("  of it, the dumped tasks waiting for a CPU", r["tasks_wait_ms_p50"], r["tasks_wait_ms_p90"], None),
            (f"pause at -v{TRACE_LEVEL}, split below", r["traced_pause_ms_p50"], r["traced_pause_ms_p90"], None)]
    rows += [(name, r["phases_ms_p50"].get(name), None, r["phases_ms_max"].get(name)) for name in PHASES]
    rows.append(("threads seized besides each process's main one (count)", None, None, r.get("threads_max")))
    load = "-".join(str(x) for x in r["load_1m"])
    output.print_table(f"forks of a running fork: parent pause per phase, ms ({r['forks']} forks at load {load}; "
                       "goal <= 10 ms)",
                       ["phase", "p50", "p90", "max"], rows)
