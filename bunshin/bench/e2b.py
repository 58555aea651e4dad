"""``bunshin bench e2b``: the unmodified ``e2b`` SDK against ``bunshin serve``, beside
bunshin's own calls on the same server, side by side in one run.

A server runs in this process on a loopback port over the same home, with the caps ``bunshin
serve`` takes by default (``Limits.of_host``: every create is admitted); the SDK reaches it by
``api_url`` / ``sandbox_url`` as a user would. Measured, alternating the two sides per round:

- create: ``Sandbox.create()`` (the ``base`` template: a snapshot restore through the
  control plane, whose next clone the server makes ahead, up to its criu run:
  ``runtime.snapshot.ahead``) against bunshin's own restore of that snapshot in process, with
  the clone made ahead and without (the whole restore on the path), and a cold create (a
  boot) of the template's image. Between two creates the clone being made ahead is waited
  for, outside the timing: sequential creates find it made; a burst finds one;
- fork of 1 / 8 / 32: ``Sandbox.fork(count=n)`` (past the SDK's own limit of 20 per call,
  the ``POST /sandboxes/{id}/fork`` it sends) against ``fork(n)`` of bunshin's HTTP client on
  another sandbox of the same template (the forks removed after each);
- ``commands.run("true")`` (envd's Connect RPC) against bunshin's ``exec`` over HTTP and in
  process; ``run_code("1")`` (the code interpreter) against bunshin's ``python`` tool;
- N sandboxes (forks of one) each running ``commands.run("true")`` back to back from its
  own thread for a fixed time, against bunshin's client doing the same ``exec``.
"""

from __future__ import annotations

import functools
import importlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.progress import Progress

from .. import console as output
from ..client import Client
from ..config import Config
from ..errors import InvalidArgument
from ..runtime import snapshot as rsnap
from ..server.admission import Limits
from ..server.e2b.templates import BASE, BASE_IMAGE, SANDBOX_MEMORY, SANDBOX_PIDS, Templates
from ..server.thread import serve_in_thread
from ..tools import ToolSet
from ..workspace import Workspace
from .stats import summary

FORK_SIZES = (1, 8, 32)
#: The most forks the SDK asks for in one call (its own check); more go to E2B's REST route.
SDK_MAX_FORKS = 20


@dataclass(frozen=True)
class Plan:
    """How much to measure: rounds per latency, fork sizes and rounds, sandboxes running at once."""

    rounds: int = 30
    fork_sizes: tuple[int, ...] = FORK_SIZES
    fork_rounds: int = 3
    concurrent: int = 32
    seconds: float = 5.0

    @classmethod
    def quick(cls) -> Plan:
        return cls(rounds=10, fork_sizes=(1, 8), fork_rounds=2, concurrent=8, seconds=2.0)


def _sdk(name: str = "e2b") -> Any:
    """One of E2B's SDKs (an optional extra)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise InvalidArgument(f"bench e2b needs E2B's SDKs: {e}", hint="pip install 'bunshin[e2b]'") from None


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def _side_by_side(cases: dict[str, Callable[[], object]], rounds: int, ratio: tuple[str, str]) -> dict[str, Any]:
    """Each case ``rounds`` times, alternating; p50 of ``ratio[0]`` over ``ratio[1]``."""
    for fn in cases.values():
        fn()  # warm up: connections, sessions, interpreters
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_ms(fn))
    out: dict[str, Any] = {k: summary(v) for k, v in times.items()}
    out[f"{ratio[0]}_over_{ratio[1]}_p50"] = round(out[ratio[0]]["p50"] / max(out[ratio[1]]["p50"], 1e-9), 2)
    return out


class _Rig:
    """The server, the SDK's options, and everything made (removed at the end)."""

    def __init__(self, cfg: Config, url: str, token: str) -> None:
        self.cfg, self.url, self.token = cfg, url, token
        self.e2b = _sdk()
        self.opts = {"api_url": url, "sandbox_url": url, "api_key": token}
        self.client = Client(url, token=token)
        self.rest = httpx.Client(base_url=url, headers={"X-API-Key": token}, timeout=600)
        self.sandboxes: list[Any] = []
        self.templates = Templates(cfg)
        self.kept = {t.id for t in self.templates.all()}  # templates made before the run stay

    def create(self) -> Any:
        sbx = self.e2b.Sandbox.create(BASE, timeout=3600, **self.opts)
        self.sandboxes.append(sbx)
        return sbx

    def fork(self, sbx: Any, n: int) -> tuple[list[str], int]:
        """``n`` forks of ``sbx`` through E2B's API: the SDK's ``fork`` up to its limit of
        :data:`SDK_MAX_FORKS`, else ``POST /sandboxes/{id}/fork`` (what the SDK sends);
        the forks' ids and how many failed."""
        if n <= SDK_MAX_FORKS:
            got = sbx.fork(count=n, **self.opts)
            return [f.sandbox_id for f in got if not isinstance(f, Exception)], sum(
                isinstance(f, Exception) for f in got)
        answer = self.rest.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": n})
        answer.raise_for_status()
        ids = [f["sandbox"]["sandboxID"] for f in answer.json() if "sandbox" in f]
        return ids, n - len(ids)

    def kill(self, ids: list[str]) -> None:
        for sid in ids:
            self.rest.delete(f"/sandboxes/{sid}")

    def close(self) -> None:
        for sbx in self.sandboxes:
            try:
                sbx.kill()
            except Exception as e:  # reported, the rest still go
                output.err.print(f"killing sandbox {sbx.sandbox_id} failed: {e}")
        self.client.close()
        self.rest.close()
        for t in self.templates.all():
            if t.id not in self.kept:
                self.templates.remove(t)


def _creates(rig: _Rig, rounds: int) -> dict[str, Any]:
    snap, _ = rig.templates.snapshot_of(BASE)
    cases: dict[str, Callable[[], Any]] = {
        "e2b_template": lambda: rig.e2b.Sandbox.create(BASE, **rig.opts),
        "bunshin_restore_ahead": lambda: snap.restore(1, ahead=True),
        "bunshin_restore": lambda: snap.restore(1),
        "cold_image": lambda: Workspace.create(BASE_IMAGE, memory=SANDBOX_MEMORY, pids=SANDBOX_PIDS, config=rig.cfg),
    }
    # time only the create: what each made is removed, and the template's next clone made
    # ahead (``runtime.snapshot.ahead``), outside the timing
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(rounds + 1):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            made = fn()
            ms = (time.perf_counter() - t0) * 1000
            _remove(made)
            rsnap.ahead.wait()
            if i:  # the first round warms up
                times[name].append(ms)
    rsnap.ahead.release(snap.id)
    out: dict[str, Any] = {k: summary(v) for k, v in times.items()}
    out["image"] = BASE_IMAGE
    out["cold_over_template_p50"] = round(out["cold_image"]["p50"] / max(out["e2b_template"]["p50"], 1e-9), 2)
    out["e2b_over_restore_p50"] = round(out["e2b_template"]["p50"] / max(out["bunshin_restore_ahead"]["p50"], 1e-9), 2)
    out["ahead_saves_ms_p50"] = round(out["bunshin_restore"]["p50"] - out["bunshin_restore_ahead"]["p50"], 2)
    return out


def _remove(made: Any) -> None:
    for m in made if isinstance(made, list) else [made]:
        if hasattr(m, "kill"):
            m.kill()
        else:
            m.remove()


def _forks(rig: _Rig, sizes: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    source_e2b, source_http = rig.create(), rig.client.get(rig.create().sandbox_id)
    rows = []
    for n in sizes:
        times: dict[str, list[float]] = {"e2b": [], "bunshin_http": []}
        failed = 0
        for _ in range(rounds):
            t0 = time.perf_counter()
            ids, bad = rig.fork(source_e2b, n)
            times["e2b"].append((time.perf_counter() - t0) * 1000)
            failed += bad
            rig.kill(ids)
            t0 = time.perf_counter()
            clones = source_http.fork(n)
            times["bunshin_http"].append((time.perf_counter() - t0) * 1000)
            _remove(list(clones))
        row: dict[str, Any] = {"count": n, "via": "sdk" if n <= SDK_MAX_FORKS else "rest", "failed": failed,
                               **{k: summary(v) for k, v in times.items()}}
        row["e2b_over_bunshin_p50"] = round(row["e2b"]["p50"] / max(row["bunshin_http"]["p50"], 1e-9), 2)
        rows.append(row)
    return rows


def _calls(rig: _Rig, rounds: int) -> dict[str, Any]:
    interpreter = _sdk("e2b_code_interpreter").Sandbox
    sbx = rig.create()
    local = Workspace.get(sbx.sandbox_id, config=rig.cfg)
    remote = rig.client.get(sbx.sandbox_id)
    commands = _side_by_side({"e2b_commands_run": lambda: sbx.commands.run("true"),
                              "bunshin_exec_http": lambda: remote.exec(["true"]),
                              "bunshin_exec_local": lambda: local.exec(["true"])},
                             rounds, ("e2b_commands_run", "bunshin_exec_http"))
    interp = interpreter.connect(sbx.sandbox_id, **rig.opts)
    tools = ToolSet.default(workdir="/tmp")
    code = _side_by_side({"e2b_run_code": lambda: interp.run_code("1"),
                          "bunshin_python_tool": lambda: tools.run_sync(local, "python", {"code": "1"})},
                         rounds, ("e2b_run_code", "bunshin_python_tool"))
    return {"commands_run_ms": commands, "run_code_ms": code}


def _busy(fns: list[Callable[[], object]], seconds: float) -> dict[str, Any]:
    """Each of ``fns`` called back to back from its own thread for ``seconds``."""
    counts, errors = [0] * len(fns), []
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        while time.monotonic() < stop:
            try:
                fns[i]()
                counts[i] += 1
            except Exception as exc:  # counted, reported
                errors.append(repr(exc))
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(fns))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"calls": sum(counts), "calls_per_s": round(sum(counts) / wall, 1), "errors": len(errors),
            "first_error": errors[0] if errors else None}


def _concurrent(rig: _Rig, n: int, seconds: float) -> dict[str, Any]:
    source = rig.create()
    ids, _ = rig.fork(source, n - 1)
    forks = [rig.e2b.Sandbox.connect(sid, **rig.opts) for sid in ids]
    rig.sandboxes += forks
    boxes = [source, *forks]
    own = [Client(rig.url, token=rig.token) for _ in boxes]
    try:
        remotes = [c.get(b.sandbox_id) for c, b in zip(own, boxes, strict=True)]
        e2b_side = _busy([functools.partial(b.commands.run, "true") for b in boxes], seconds)
        http_side = _busy([functools.partial(r.exec, ["true"]) for r in remotes], seconds)
    finally:
        for c in own:
            c.close()
    return {"sandboxes": len(boxes), "seconds": seconds, "e2b_commands_run": e2b_side, "bunshin_exec_http": http_side,
            "e2b_over_bunshin_calls_per_s": round(e2b_side["calls_per_s"] / max(http_side["calls_per_s"], 1e-9), 2)}


def run(cfg: Config, plan: Plan | None = None) -> dict[str, Any]:
    plan = plan or Plan()
    _sdk("e2b_code_interpreter")
    token = secrets.token_urlsafe(24)
    with Progress(transient=True, console=output.err) as progress, \
            serve_in_thread(cfg, token, limits=Limits.of_host()) as url:  # as `bunshin serve` caps by default
        rig = _Rig(cfg, url, token)
        try:
            task = progress.add_task("the base template (the host image booted once)", total=None)
            rig.create()
            progress.update(task, description="create: template restore vs cold")
            creates = _creates(rig, plan.rounds)
            progress.update(task, description="fork")
            forks = _forks(rig, plan.fork_sizes, plan.fork_rounds)
            progress.update(task, description="commands.run and run_code")
            calls = _calls(rig, plan.rounds)
            progress.update(task, description=f"{plan.concurrent} sandboxes at once")
            busy = _concurrent(rig, plan.concurrent, plan.seconds)
        finally:
            rig.close()
    return {"plan": asdict(plan), "create_ms": creates, "fork_ms": forks, **calls, "concurrent": busy}


def rows(r: dict[str, Any]) -> list[tuple[str, str, str, float, float, str]]:
    """(what, E2B's side, bunshin's side, E2B p50 ms, bunshin p50 ms, ratio) per timed call."""
    c, cmd, code = r["create_ms"], r["commands_run_ms"], r["run_code_ms"]
    out = [("create", "Sandbox.create (template)", "cold create (boot)", c["e2b_template"]["p50"],
            c["cold_image"]["p50"], f"{c['cold_over_template_p50']}x faster"),
           ("create", "Sandbox.create (template)", "Snapshot.restore(1, ahead=True), in process",
            c["e2b_template"]["p50"], c["bunshin_restore_ahead"]["p50"], f"{c['e2b_over_restore_p50']}x"),
           ("create", "Sandbox.create (template)", "Snapshot.restore(1), nothing made ahead", c["e2b_template"]["p50"],
            c["bunshin_restore"]["p50"], f"{c['ahead_saves_ms_p50']} ms more")]
    out += [(f"fork {f['count']}", f"Sandbox.fork(count={f['count']})" if f["via"] == "sdk" else
             f"POST /sandboxes/{{id}}/fork count={f['count']}", f"fork({f['count']}) over HTTP",
             f["e2b"]["p50"], f["bunshin_http"]["p50"], f"{f['e2b_over_bunshin_p50']}x") for f in r["fork_ms"]]
    out += [("command", "commands.run('true')", "exec true over HTTP", cmd["e2b_commands_run"]["p50"],
             cmd["bunshin_exec_http"]["p50"], f"{cmd['e2b_commands_run_over_bunshin_exec_http_p50']}x"),
            ("python", "run_code('1')", "python tool, in process", code["e2b_run_code"]["p50"],
             code["bunshin_python_tool"]["p50"], f"{code['e2b_run_code_over_bunshin_python_tool_p50']}x")]
    return out


def print_report(r: dict[str, Any]) -> None:
    output.print_table("bunshin bench e2b: the e2b SDK against bunshin's own calls, same server (p50)",
                       ["CALL", "E2B SDK", "BUNSHIN", "E2B ms", "BUNSHIN ms", "E2B/BUNSHIN"],
                       [(a, b, c, d, e, f) for a, b, c, d, e, f in rows(r)])
    b = r["concurrent"]
    output.print_table(f"{b['sandboxes']} sandboxes running commands at once, {b['seconds']} s",
                       ["SIDE", "CALLS", "CALLS/S", "ERRORS"],
                       [("e2b commands.run", b["e2b_commands_run"]["calls"], b["e2b_commands_run"]["calls_per_s"],
                         b["e2b_commands_run"]["errors"]),
                        ("bunshin exec (HTTP)", b["bunshin_exec_http"]["calls"], b["bunshin_exec_http"]["calls_per_s"],
                         b["bunshin_exec_http"]["errors"])])


def plot(r: dict[str, Any], path: Path) -> Path:
    """A bar chart of the p50s side by side (``--report``)."""
    import matplotlib  # noqa: PLC0415 (only for --report)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rs = rows(r)
    labels = [f"{a}\n{c}" for a, _, c, *_ in rs]
    x = range(len(rs))
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rs)), 4.5))
    ax.bar([i - 0.2 for i in x], [row[3] for row in rs], 0.4, label="e2b SDK", color="#d9822b")
    ax.bar([i + 0.2 for i in x], [row[4] for row in rs], 0.4, label="bunshin", color="#3465a4")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("p50 ms (log)")
    ax.set_title("bench e2b: the e2b SDK on bunshin serve against bunshin's own calls")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
