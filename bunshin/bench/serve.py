"""``bunshin bench serve``: the HTTP API against in-process calls, side by side in one run.

A server runs in this process on a loopback port over the same home. Measured on the
same workspaces, alternating local and remote per round: exec of ``true``, a tool call
(``bash`` in the persistent session) and ``fork(1)`` (the clone removed after each).
Then exec throughput: 1, 8 and 32 clients (threads, each its own connection and
workspace) calling ``exec true`` back to back for a fixed time.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from rich.progress import Progress

from .. import console as output
from ..client import Client
from ..config import Config
from ..server.thread import serve_in_thread
from ..tools import ToolSet
from ..workspace import Workspace
from ..workspace.protocol import WorkspaceAPI
from .stats import summary

CLIENTS = (1, 8, 32)


def _timed(fn: Callable[[WorkspaceAPI], object], ws: WorkspaceAPI) -> float:
    t0 = time.perf_counter()
    fn(ws)
    return (time.perf_counter() - t0) * 1000


def _fork_and_remove(ws: WorkspaceAPI) -> None:
    for clone in ws.fork(1):
        clone.remove()


def _latencies(local: WorkspaceAPI, remote: WorkspaceAPI, rounds: int, forks: int) -> dict[str, Any]:
    tools = ToolSet.default(workdir="/tmp")
    out: dict[str, Any] = {}
    cases: dict[str, tuple[Callable[[WorkspaceAPI], object], int]] = {
        "exec_ms": (lambda ws: ws.exec(["true"]), rounds),
        "tool_call_ms": (lambda ws: tools.run_sync(ws, "bash", {"command": "true"}), rounds),
        "fork_ms": (_fork_and_remove, forks),
    }
    for name, (fn, n) in cases.items():
        fn(local), fn(remote)  # warm up: sessions, connections
        times: dict[str, list[float]] = {"local": [], "http": []}
        for _ in range(n):
            times["local"].append(_timed(fn, local))
            times["http"].append(_timed(fn, remote))
        out[name] = {k: summary(v) for k, v in times.items()}
        out[name]["http_over_local_p50"] = round(out[name]["http"]["p50"] / max(out[name]["local"]["p50"], 1e-9), 2)
    return out


def _throughput(url: str, token: str, workspaces: list[str], clients: int, seconds: float) -> dict[str, Any]:
    counts = [0] * clients
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        with Client(url, token=token) as c:
            ws = c.get(workspaces[i])
            while time.monotonic() < stop:
                try:
                    ws.exec(["true"])
                    counts[i] += 1
                except Exception as exc:  # counted, reported
                    errors.append(repr(exc))
                    return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "calls": sum(counts), "calls_per_s": round(sum(counts) / wall, 1),
            "errors": len(errors), "first_error": errors[0] if errors else None}


def run(cfg: Config, *, rounds: int = 30, forks: int = 8, seconds: float = 5.0,
        clients: tuple[int, ...] = CLIENTS) -> dict[str, Any]:
    token = secrets.token_urlsafe(24)
    made: list[Workspace] = []
    try:
        with Progress(transient=True, console=output.err) as progress, serve_in_thread(cfg, token) as url, \
                Client(url, token=token) as client:
            task = progress.add_task("latency: local vs HTTP", total=None)
            local = Workspace.create("host", memory="512M", config=cfg)
            made.append(local)
            remote_ws = Workspace.create("host", memory="512M", config=cfg)
            made.append(remote_ws)
            lat = _latencies(local, client.get(remote_ws.id), rounds, forks)
            progress.update(task, description="exec throughput over HTTP")
            for _ in range(max(clients) - 1):
                made.append(Workspace.create("host", memory="256M", config=cfg))
            ids = [w.id for w in made[1:]]
            tput = [_throughput(url, token, ids, n, seconds) for n in clients]
    finally:
        for ws in made:
            ws.remove()
    return {"rounds": rounds, "forks": forks, "seconds": seconds, **lat, "exec_throughput": tput}


def print_report(r: dict[str, Any]) -> None:
    rows = []
    for key, label in (("exec_ms", "exec `true`"), ("tool_call_ms", "tool call (bash, session)"),
                       ("fork_ms", "fork(1) + remove")):
        e = r[key]
        rows.append((label, e["local"]["p50"], e["http"]["p50"], e["local"]["p95"], e["http"]["p95"],
                     f"{e['http_over_local_p50']}x"))
    output.print_table(f"bunshin bench serve: local vs HTTP on loopback ({r['rounds']} rounds, {r['forks']} forks)",
                       ["CALL", "LOCAL P50 ms", "HTTP P50 ms", "LOCAL P95", "HTTP P95", "HTTP/LOCAL"], rows)
    output.print_table(f"exec `true` over HTTP, {r['seconds']} s per row",
                       ["CLIENTS", "CALLS", "CALLS/S", "ERRORS"],
                       [(t["clients"], t["calls"], t["calls_per_s"], t["errors"]) for t in r["exec_throughput"]])
