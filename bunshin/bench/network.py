"""``bunshin bench network``: what a way out costs a workspace and its forks, and what it lets through.

All traffic stays on this machine: the "internet" is ``bench.internet`` (servers in a
network namespace of their own, on TEST-NET addresses routed from the host).

- ``fork``: pause and restore of ``fork(1)``, a workspace without egress against one
  with it, alternating round by round (same load for both); whether the clone has an
  address of its own.
- ``create``: ``Workspace.create`` without and with egress, alternating: the difference is
  the veth + nftables setup per workspace.
- ``throughput``: one workspace with egress downloading from the internet's HTTP server
  (timed inside); the host downloading the same (the server's own ceiling); ports in: the
  host reading from a server inside through a published port (``Workspace.publish``).
- ``clones``: N clones of a workspace with egress (64; 8 with ``--quick``) each fetching
  1 MiB at once: wall time and how many got it.
- ``mechanism``: pasta (passt's user-mode stack, one process per workspace) against
  veth + nftables: its setup per workspace, its throughput, whether a workspace using
  it forks, and what a hostile workload reaches with each (canaries: a service on the
  host's loopback, one on a host address, cloud metadata 169.254.169.254, a private
  address; the test internet's web server as the one that should answer).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..config import Config
from ..workspace import Workspace
from .internet import Internet
from .stats import percentile

CANARY_PORT = 8710
METADATA, PRIVATE = "169.254.169.254", "10.99.0.1"

FETCH = textwrap.dedent("""
    import sys, time, urllib.request
    t0 = time.perf_counter(); n = 0
    with urllib.request.urlopen(sys.argv[1], timeout=30) as r:
        while piece := r.read(1 << 20):
            n += len(piece)
    print(n, time.perf_counter() - t0)
""")

PROBE = textwrap.dedent("""
    import errno, json, socket, struct, sys
    gw = None
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            gw = socket.inet_ntoa(struct.pack("<L", int(f[2], 16)))
    out = {}
    for name, target in json.loads(sys.argv[1]).items():
        host, port = target.rsplit(":", 1)
        host = gw if host == "GATEWAY" else host
        if host is None:
            out[name] = "no route"
            continue
        s = socket.socket(); s.settimeout(2)
        try:
            s.connect((host, int(port))); out[name] = "reached"
        except OSError as e:
            out[name] = "timeout" if isinstance(e, TimeoutError) else errno.errorcode.get(e.errno, type(e).__name__)
        finally:
            s.close()
    print(json.dumps(out))
""")

SERVE_BYTES = textwrap.dedent("""
    import socket, sys
    n = int(sys.argv[1]); block = bytes(1 << 20)
    srv = socket.create_server(("127.0.0.1", 9000)); open("/tmp/bytes.ready", "w").close()
    while True:
        c, _ = srv.accept(); left = n
        while left:
            left -= c.send(block[:min(left, len(block))])
        c.close()
""")


def _p50(values: list[float]) -> float:
    return round(percentile(values, 50), 2) if values else float("nan")


def _ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def fork_side_by_side(cfg: Config, rounds: int) -> dict[str, Any]:
    """fork(1) of a workspace without egress and of one with it, alternating."""
    off = Workspace.create("host", config=cfg, memory="512M")
    on = Workspace.create("host", config=cfg, memory="512M", network="egress")
    got: dict[str, dict[str, list[float]]] = {k: {"pause_ms": [], "restore_ms": []} for k in ("off", "on")}
    clone_address = None
    try:
        for _ in range(rounds):
            for key, ws in (("off", off), ("on", on)):
                (clone,) = ws.fork(1)
                snap = ws.last_fork
                if snap is not None:
                    got[key]["pause_ms"].append(snap.pause_ms)
                got[key]["restore_ms"].append(float(clone.record.extra.get("restore_ms", float("nan"))))
                if key == "on":
                    clone_address = clone.network_address()
                clone.remove()
    finally:
        off.remove()
        on.remove()
    out: dict[str, Any] = {k: {m: _p50(v) for m, v in d.items()} | {"rounds": rounds} for k, d in got.items()}
    out["restore_on_over_off"] = round(out["on"]["restore_ms"] / out["off"]["restore_ms"], 3)
    out["pause_on_over_off"] = round(out["on"]["pause_ms"] / out["off"]["pause_ms"], 3)
    out["clone_has_own_address"] = clone_address is not None
    return out


def create_side_by_side(cfg: Config, rounds: int) -> dict[str, Any]:
    """Workspace.create without and with egress, alternating (removed at once)."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for key in ("off", "on"):
            t0 = time.perf_counter()
            ws = Workspace.create("host", config=cfg, memory="256M", network="egress" if key == "on" else "none")
            times[key].append((time.perf_counter() - t0) * 1000)
            ws.remove()
    off, on = _p50(times["off"]), _p50(times["on"])
    return {"off_ms": off, "on_ms": on, "egress_setup_ms": round(on - off, 2), "rounds": rounds}


def fetch_inside(ws: Workspace, url: str) -> dict[str, Any]:
    r = ws.exec(["python3", "-c", FETCH, url], timeout=300)
    if r.exit_code != 0:
        return {"ok": False, "error": r.stderr.strip().splitlines()[-1:]}
    n, secs = r.stdout.split()
    return {"ok": True, "bytes": int(n), "mb_per_s": round(int(n) / float(secs) / 1e6, 1)}


def fetch_host(url: str) -> float:
    import urllib.request

    t0, n = time.perf_counter(), 0
    with urllib.request.urlopen(url, timeout=30) as r:
        while piece := r.read(1 << 20):
            n += len(piece)
    return round(n / (time.perf_counter() - t0) / 1e6, 1)


def ports_in(ws: Workspace, size: int) -> dict[str, Any]:
    """The host reading ``size`` bytes from a server inside through a published port."""
    ws.commands.spawn(["python3", "-c", SERVE_BYTES, str(size)])
    ready = ws.exec(["sh", "-c", "for i in $(seq 200); do [ -e /tmp/bytes.ready ] && exit 0; sleep 0.05; done; exit 1"])
    if ready.exit_code != 0:
        return {"ok": False, "error": "the server inside did not start"}
    p = ws.publish(9000)
    try:
        t0, n = time.perf_counter(), 0
        with socket.create_connection(("127.0.0.1", p.host_port), timeout=30) as s:
            while piece := s.recv(1 << 20):
                n += len(piece)
        return {"ok": n == size, "bytes": n, "mb_per_s": round(n / (time.perf_counter() - t0) / 1e6, 1)}
    finally:
        ws.unpublish(p.host_port)


def throughput(cfg: Config, inet: Internet, size: int) -> dict[str, Any]:
    ws = Workspace.create("host", config=cfg, memory="512M", network="egress")
    try:
        return {"bytes": size, "egress": fetch_inside(ws, inet.url(f"/bytes/{size}")),
                "host_direct_mb_per_s": fetch_host(inet.url(f"/bytes/{size}")), "ports_in": ports_in(ws, size)}
    finally:
        ws.remove()


def clones_fetch(cfg: Config, inet: Internet, n: int) -> dict[str, Any]:
    """``n`` clones of a workspace with egress, each fetching 1 MiB at once."""
    parent = Workspace.create("host", config=cfg, memory="512M", network="egress")
    clones: list[Workspace] = []
    try:
        fork_ms, clones = _ms(lambda: parent.fork(n))
        url = inet.url(f"/bytes/{1 << 20}")
        with ThreadPoolExecutor(max_workers=n) as pool:
            wall_ms, results = _ms(lambda: list(pool.map(lambda c: fetch_inside(c, url), clones)))
        ok = [r for r in results if r["ok"]]
        errors = sorted({str(r.get("error")) for r in results if not r["ok"]})
        return {"clones": n, "fork_ms": round(fork_ms, 1), "fetched": len(ok), "wall_ms": round(wall_ms, 1),
                "with_own_address": sum(c.network_address() is not None for c in clones), "errors": errors[:3]}
    finally:
        for c in clones:
            c.remove()
        parent.remove()


@contextlib.contextmanager
def canaries(inet: Internet) -> Iterator[dict[str, str]]:
    """Listeners a hostile workload would want: on the host's loopback, on a host address
    (the internet link's host side), and in the internet's namespace on a metadata and
    a private address (routed from the host). Yields name -> target for ``PROBE``."""
    for addr in (METADATA, PRIVATE):
        inet.add_address(addr)
    listeners = [socket.create_server(("127.0.0.1", CANARY_PORT)), socket.create_server(("0.0.0.0", CANARY_PORT + 1))]
    inside = subprocess.Popen(["nsenter", f"--net={inet.netns}", "python3", "-c",
                               f"import socket,time; s=socket.create_server(('0.0.0.0', {CANARY_PORT})); time.sleep(600)"])
    stop = threading.Event()

    def accept(s: socket.socket) -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                s.accept()[0].close()

    threads = [threading.Thread(target=accept, args=(s,), daemon=True) for s in listeners]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)  # the listener in the namespace binds
        yield {"host_loopback_service": f"GATEWAY:{CANARY_PORT}", "host_address_service": f"{inet.host_addr}:{CANARY_PORT + 1}",
               "cloud_metadata": f"{METADATA}:{CANARY_PORT}", "private_range": f"{PRIVATE}:{CANARY_PORT}",
               "internet_web": f"{inet.web}:80"}
    finally:
        stop.set()
        inside.kill()
        inside.wait()
        for s in listeners:
            s.close()
        for addr in (METADATA, PRIVATE):  # their host routes too: the internet may serve others after
            inet.remove_address(addr)
        for addr in (METADATA, PRIVATE):
            inet.remove_address(addr)


def probe(ws: Workspace, targets: dict[str, str]) -> dict[str, str]:
    r = ws.exec(["python3", "-c", PROBE, json.dumps(targets)], timeout=120)
    return dict(json.loads(r.stdout)) if r.exit_code == 0 else {"error": r.stderr.strip()[-200:]}


PASTA = ["pasta", "--config-net", "--quiet", "--runas", "0:0", "--"]


def in_pasta(argv: list[str], timeout: float = 300) -> tuple[float, subprocess.CompletedProcess[str]]:
    """``argv`` run by pasta in a user and network namespace it makes and wires (its
    defaults: the host's addresses and routes copied in, the gateway mapped to the
    host's loopback); wall ms and the result. pasta, run as root, will not join a
    namespace it did not make (it drops its capabilities first), so it makes its own."""
    return _ms(lambda: subprocess.run([*PASTA, *argv], capture_output=True, text=True, timeout=timeout))


def pasta_side(inet: Internet, rounds: int, size: int, targets: dict[str, str]) -> dict[str, Any]:
    bare, wired = [], []
    for _ in range(rounds):  # alternating: a bare network namespace, and one pasta wires
        bare.append(_ms(lambda: subprocess.run(["unshare", "--net", "true"], check=True))[0])
        ms, run = in_pasta(["true"])
        if run.returncode != 0:
            return {"ok": False, "error": run.stderr.strip()[-300:]}
        wired.append(ms)
    _, fetched = in_pasta(["python3", "-c", FETCH, inet.url(f"/bytes/{size}")])
    _, probed = in_pasta(["python3", "-c", PROBE, json.dumps(targets)])
    n, secs = (fetched.stdout.split() + ["0", "1"])[:2]
    return {"setup_ms": round(_p50(wired) - _p50(bare), 2), "netns_ms": _p50(bare), "pasta_ms": _p50(wired),
            "throughput": {"ok": fetched.returncode == 0, "bytes": int(n), "mb_per_s": round(int(n) / float(secs) / 1e6, 1)},
            "reach": json.loads(probed.stdout) if probed.returncode == 0 else {"error": probed.stderr[-200:]},
            "processes_per_workspace": 1,
            "fork": "not measured: the tap device inside belongs to a pasta process outside the workspace, which "
                    "CRIU does not take; each clone would need its tap removed and a pasta of its own"}


def mechanism(cfg: Config, inet: Internet, rounds: int, size: int, veth_setup_ms: float) -> dict[str, Any]:
    """pasta against veth + nftables: setup, throughput, reach of a hostile workload."""
    with canaries(inet) as targets:
        veth = Workspace.create("host", config=cfg, memory="512M", network="egress")
        try:
            out = {"veth_nftables": {"setup_ms": veth_setup_ms, "throughput": fetch_inside(veth, inet.url(f"/bytes/{size}")),
                                     "reach": probe(veth, targets), "processes_per_workspace": 0}}
        finally:
            veth.remove()
        out["pasta"] = pasta_side(inet, rounds, size, targets)
    return out


def run(cfg: Config, *, quick: bool = False) -> dict[str, Any]:
    rounds = 3 if quick else 10
    size = (64 if quick else 256) << 20
    with Internet.start(Path(tempfile.mkdtemp(prefix="bunshin-inet-")), dns=False) as inet:
        fork = fork_side_by_side(cfg, rounds)
        create = create_side_by_side(cfg, rounds)
        return {"quick": quick, "fork": fork, "create": create, "throughput": throughput(cfg, inet, size),
                "clones": clones_fetch(cfg, inet, 8 if quick else 64),
                "mechanism": mechanism(cfg, inet, min(rounds, 5), size, create["egress_setup_ms"])}


def print_report(r: dict[str, Any]) -> None:
    f, c, t = r["fork"], r["create"], r["throughput"]
    print(f"fork(1) p50: restore {f['off']['restore_ms']} ms off, {f['on']['restore_ms']} ms with egress "
          f"(x{f['restore_on_over_off']}); pause {f['off']['pause_ms']} / {f['on']['pause_ms']} ms; "
          f"clone has its own address: {f['clone_has_own_address']}")
    print(f"create p50: {c['off_ms']} ms off, {c['on_ms']} ms with egress (+{c['egress_setup_ms']} ms)")
    print(f"throughput: egress {t['egress'].get('mb_per_s')} MB/s (host direct {t['host_direct_mb_per_s']}), "
          f"ports in {t['ports_in'].get('mb_per_s')} MB/s")
    cl = r["clones"]
    print(f"{cl['clones']} clones fetching 1 MiB at once: {cl['fetched']} got it in {cl['wall_ms']} ms {cl['errors']}")
    for name, m in r["mechanism"].items():
        print(f"{name}: setup {m.get('setup_ms')} ms, {m.get('throughput', {}).get('mb_per_s')} MB/s, reach {m.get('reach')}")
