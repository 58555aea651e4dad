"""``bunshin bench read-bounds``: what a big file read through the server costs the server.

A real ``bunshin serve`` (a process of its own, over this config's home, on a loopback
port) serves one workspace holding a sparse file (``truncate``: it costs the workspace
nothing). The file is read through each path a caller has to it, one after another: the
files API (streamed), the ``read_file`` tool, SWE-ReX's ``read_file`` and a download of
it in pieces (as Harbor's adapter does). Before each, the server's peak resident memory
is reset (``/proc/PID/clear_refs``: 5); after it, the peak (``VmHWM``) less the resident
memory before is what that path cost it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from .. import console as output
from ..client import Client, RemoteWorkspace
from ..config import Config

DOWNLOAD_CHUNK = 4 << 20


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) << 10
    return 0


def _serve(cfg: Config) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu), "BUNSHIN_TMPFS": str(cfg.tmpfs)}
    proc = subprocess.Popen([sys.executable, "-m", "bunshin.cli.main", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/v1/health", timeout=1)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("bunshin serve did not start") from None
            time.sleep(0.1)


def _paths(url: str, token: str, ws: RemoteWorkspace, path: str) -> dict[str, Callable[[], int]]:
    auth = {"Authorization": f"Bearer {token}"}

    def files_api() -> int:
        got = 0
        with httpx.stream("GET", f"{url}/v1/workspaces/{ws.id}/files/content", params={"path": path},
                          headers=auth, timeout=600) as r:
            for piece in r.iter_bytes():
                got += len(piece)
        return got

    def tool() -> int:
        r = httpx.post(f"{url}/v1/workspaces/{ws.id}/tools/read_file", headers=auth, timeout=600,
                       json={"arguments": {"path": path}})
        return len(r.json()["output"])

    def swerex() -> int:
        r = httpx.post(f"{url}/swerex/{ws.id}/read_file", headers={"X-API-Key": token}, json={"path": path},
                       timeout=600)
        return len(r.content)

    def download() -> int:
        got = 0
        while piece := ws.files.read(path, offset=got, length=DOWNLOAD_CHUNK):
            got += len(piece)
        return got

    return {"files_api": files_api, "read_file_tool": tool, "swerex_read_file": swerex, "download": download}


def run(cfg: Config, *, mib: int = 600) -> dict[str, Any]:
    """Each path's cost to the server reading a sparse file of ``mib`` MiB."""
    proc, url = _serve(cfg)
    try:
        token = cfg.paths.server_token.read_text().strip()
        with Client(url, token=token) as c:
            ws = c.create(memory="256M")
            try:
                ws.exec(["truncate", "-s", f"{mib}M", "/root/sparse"])
                out: dict[str, Any] = {"file_mib": mib, "server_rss_mib": _status(proc.pid, "VmRSS") >> 20}
                for name, read in _paths(url, token, ws, "/root/sparse").items():
                    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # the peak starts again from now
                    rss = _status(proc.pid, "VmRSS")
                    t0 = time.perf_counter()
                    answered = read()
                    out[name] = {"answered_bytes": answered, "seconds": round(time.perf_counter() - t0, 2),
                                 "peak_growth_mib": round((_status(proc.pid, "VmHWM") - rss) / (1 << 20), 1)}
                return out
            finally:
                ws.remove()
    finally:
        proc.terminate()
        proc.wait(60)


def print_report(r: dict[str, Any]) -> None:
    rows = [(name, output.human_bytes(v["answered_bytes"]), f"{v['peak_growth_mib']} MiB", f"{v['seconds']} s")
            for name, v in r.items() if isinstance(v, dict)]
    output.print_table(f"a {r['file_mib']} MiB sparse file read through the server (its RSS "
                       f"{r['server_rss_mib']} MiB before)", ["PATH", "ANSWERED", "SERVER PEAK +", "TIME"], rows)
