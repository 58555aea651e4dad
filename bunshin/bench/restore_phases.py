"""Where a restore's time goes, and ``bunshin bench restore-phases``.

``parse(log)`` splits one ``criu restore -v4`` log at CRIU's own markers:

- ``setup``: from criu's start: its kernel cache, the CPU check, the images, the
  ``pre-restore`` scripts;
- ``namespaces``: the root task and its new namespaces: user (CRIU's usernsd), UTS,
  IPC, and the mount namespace built from the images (a copy of criu's own first);
- ``tasks``: every other task forked, its files, sockets and memory restored, until
  each one is;
- ``finish``: usernsd stopped, ghost files cleaned, the pidfile, the network unlock,
  seccomp, the tasks resumed.

``outside`` is what bunshin measures of the criu run (``restore_ms``: request to exit)
minus the log's span: with a warm criu (``criu.restore``) the helper's placement of it, the
RPC request and answer and criu's exit; run as a command, also the exec and dynamic loading.

``run`` restores ``clones`` clones of a workspace holding a heap (as ``bench fork``'s),
keeps their logs, splits each, and reports the p50 and p90 of every phase, of
``outside``, and of bunshin's steps around criu (``restore_steps_ms``), with the
clones already alive counted (``--json``: ``r["phases_ms_p50"][name]``,
``r["restore_ms_p50"]``, ``r["batches"]``: the same per batch, to see growth).

``cpu_ms_per_clone``: where a clone's CPU went, per batch and over the run (``cpu_split``):
``bunshin``, this process's threads (the restore threads, the launcher's reader);
``helper``, the criu launcher's helper (``zygote.py``: the warm criu's namespaces, its
spawn and placement); ``clones``, the clones' own cgroups right after the batch (criu from
its placement on, the tasks it forks, their first moments). Not in any of them: each warm
criu's CPU before its placement (exec, loading, start: ~2.5-3 ms, in the helper's cgroup).
The logs are kept at ``-v4`` here, which costs criu more than a plain restore's ``-v2``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..runtime import snapshot as rsnap
from ..runtime.container.cgroups import WorkspaceCgroup
from ..runtime.criu import prepared
from ..runtime.state.store import Store
from ..workspace import Workspace
from ..workspace.batch import remove_all
from .fork import start_heap
from .stats import percentile

_TS = re.compile(r"^\((\d+\.\d+)\)")
#: (phase the marker starts, what the log line says), in log order; setup starts at 0
MARKERS = (
    ("namespaces", re.compile(r"Forking task with 1 pid")),
    ("tasks", re.compile(r"Running post-setup-namespaces scripts")),
    ("finish", re.compile(r"uns: calling exit_usernsd|uns: daemon stopped")),
)
PHASES = ("setup", *(name for name, _ in MARKERS))
_END = re.compile(r"Restore finished successfully")
BATCH = 32  # clones restored per call


@dataclass(frozen=True)
class RestorePhases:
    span_ms: float  # criu's start to its last line, as the log tells it
    phases_ms: dict[str, float]  # every name of PHASES


def parse(log: str) -> RestorePhases | None:
    """One restore's time per phase; None for a log that did not finish."""
    at: dict[str, float] = {"setup": 0.0}
    nxt, t = 0, 0.0
    for line in log.splitlines():
        m = _TS.match(line)
        if not m:
            continue
        t = float(m.group(1)) * 1000
        if nxt < len(MARKERS) and MARKERS[nxt][1].search(line):
            at[MARKERS[nxt][0]] = t
            nxt += 1
        if _END.search(line):
            marks = [(name, at[name]) for name in PHASES if name in at] + [("end", t)]
            spent = dict.fromkeys(PHASES, 0.0)
            for (name, start), (_, stop) in zip(marks, marks[1:], strict=False):
                spent[name] = round(stop - start, 3)
            return RestorePhases(round(t, 3), spent)
    return None


@dataclass(frozen=True)
class CpuMark:
    """CPU time used so far (seconds): this process's threads, the criu helper's."""

    bunshin: float
    helper: float


def _helper_seconds() -> float:
    """The criu launcher's helper's CPU time so far (its own, not its children's); 0 without one."""
    lch = prepared.launcher()
    if lch is None:
        return 0.0
    try:
        with open(f"/proc/{lch.pid}/schedstat") as f:  # nanoseconds on CPU
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_mark() -> CpuMark:
    return CpuMark(time.process_time(), _helper_seconds())  # all threads, exited ones too; not tick-rounded


def cpu_split(before: CpuMark, after: CpuMark, clones_s: float, n: int) -> dict[str, float]:
    """ms of CPU per clone of a batch of ``n``: this process, the helper, the clones' cgroups, and their sum."""
    parts = {"bunshin": after.bunshin - before.bunshin, "helper": after.helper - before.helper, "clones": clones_s}
    out = {k: round(v * 1000 / max(n, 1), 2) for k, v in parts.items()}
    out["total"] = round(sum(parts.values()) * 1000 / max(n, 1), 2)
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(values, 50), 2), "p90": round(percentile(values, 90), 2)} if values else {}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    split = [r for r in rows if r["phases_ms"] is not None]
    steps = sorted({k for r in rows for k in r["steps_ms"]})
    return {
        "restore_ms": _stats([r["restore_ms"] for r in rows]),
        "log_span_ms": _stats([r["span_ms"] for r in split]),
        "outside_ms": _stats([r["restore_ms"] - r["span_ms"] for r in split]),
        "phases_ms": {k: _stats([r["phases_ms"][k] for r in split]) for k in PHASES},
        "steps_ms": {k: _stats([r["steps_ms"][k] for r in rows if k in r["steps_ms"]]) for k in steps},
    }


def run(cfg: Config, *, clones: int = 64, heap_mib: int = 64) -> dict[str, Any]:
    """Restore ``clones`` clones in batches of ``BATCH``, every one split into its phases."""
    if clones < 1 or heap_mib < 1:
        raise InvalidArgument(f"need clones >= 1 and heap >= 1 MiB, not {clones} and {heap_mib}",
                              hint="pass --clones 1 or more and --heap-mib 1 or more")
    started = time.monotonic()
    parent = start_heap(cfg, heap_mib)
    made: list[Workspace] = []
    batches: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    cpu: list[tuple[dict[str, float], int]] = []
    try:
        time.sleep(1.0)  # the parent's tool call settled
        snap = parent.snapshot()
        try:
            while len(made) < clones:
                alive = len(made)
                with Store.open(cfg.db_path) as store:
                    mark = cpu_mark()
                    recs = rsnap.restore(cfg, store, snap.record, min(BATCH, clones - alive), keep_logs=True)
                    end = cpu_mark()
                made += [Workspace(cfg, r) for r in recs]
                split = cpu_split(mark, end, sum(WorkspaceCgroup.of_record(r).cpu_seconds() for r in recs), len(recs))
                cpu.append((split, len(recs)))
                batch = [_row(r.extra) for r in recs]
                rows += batch
                batches.append({"alive_before": alive, **_summary(batch), "cpu_ms_per_clone": split})
        finally:
            remove_all(made)
            snap.remove()
    finally:
        parent.remove()
    s = _summary(rows)
    return {
        "clones": clones, "heap_mib": heap_mib,
        "restore_ms_p50": s["restore_ms"].get("p50"),
        "phases_ms_p50": {k: v.get("p50") for k, v in s["phases_ms"].items()},
        "outside_ms_p50": s["outside_ms"].get("p50"),
        "steps_ms_p50": {k: v.get("p50") for k, v in s["steps_ms"].items()},
        "cpu_ms_per_clone": {k: round(sum(c[k] * n for c, n in cpu) / max(sum(n for _, n in cpu), 1), 2)
                             for k in ("bunshin", "helper", "clones", "total")},
        "all": s, "batches": batches,
        "wall_s": round(time.monotonic() - started, 1),
    }


def _row(extra: dict[str, Any]) -> dict[str, Any]:
    log = Path(extra["restore_log"])
    try:
        split = parse(log.read_text(errors="replace"))
    finally:
        log.unlink(missing_ok=True)
    return {"restore_ms": float(extra["restore_ms"]), "steps_ms": dict(extra.get("restore_steps_ms") or {}),
            "span_ms": split.span_ms if split else 0.0, "phases_ms": split.phases_ms if split else None}


def print_report(r: dict[str, Any]) -> None:
    s = r["all"]
    rows = [("criu run (restore_ms)", s["restore_ms"].get("p50"), s["restore_ms"].get("p90"))]
    rows += [(f"  {k}", v.get("p50"), v.get("p90")) for k, v in s["phases_ms"].items()]
    rows.append(("  outside the log", s["outside_ms"].get("p50"), s["outside_ms"].get("p90")))
    rows += [(f"step {k}", v.get("p50"), v.get("p90")) for k, v in s["steps_ms"].items()]
    output.print_table(f"restore of {r['clones']} clones ({r['heap_mib']} MiB heap): ms per clone",
                       ["phase", "p50", "p90"], rows)
    output.print_table("by batch: criu run p50 as clones accumulate", ["alive before", "p50", "p90"],
                       [(b["alive_before"], b["restore_ms"].get("p50"), b["restore_ms"].get("p90"))
                        for b in r["batches"]])
    output.print_table("CPU per clone, ms (the warm criu's start before its placement not counted)",
                       ["bunshin", "helper", "clones' cgroups", "total"], [tuple(r["cpu_ms_per_clone"].values())])
