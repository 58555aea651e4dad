"""No caller or workspace can exhaust the server's host: a real ``bunshin serve`` (its own
process, loopback HTTP) reads a 600 MiB sparse file (costing the workspace nothing) through
every path a caller has to it, the files API, the ``read_file`` tool, SWE-ReX's
``read_file`` and an adapter's download, while its peak memory (``VmHWM``) is measured:
each reads at most what it answers, a piece at a time, and a whole read over the cap is
refused by name. Request bodies and out-of-range numbers are bounded the same way."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bunshin.client import Client
from bunshin.runtime.kernel.limits import MAX_FILE_BYTES, MAX_TEXT_FILE_BYTES
from bunshin.tools.builtin import MAX_READ_BYTES

pytestmark = [pytest.mark.integration, pytest.mark.criu]
#: Twice over what the server may grow by, so a path that held the file whole would fail; each
#: path streams it in full, so its size is what the test costs.
SPARSE = 320 << 20
#: What the server may grow by while it serves all the reads below (a 600 MiB file went
#: whole into its memory before, 1.1-1.9 GiB).
GROWTH = 128 << 20


@dataclass
class Server:
    url: str
    token: str
    pid: int

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def peak(self) -> int:
        """The server's peak resident memory so far (``VmHWM``), in bytes."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmHWM")


@pytest.fixture
def server(no_leaks) -> Iterator[Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "BUNSHIN_HOME": str(no_leaks.home), "BUNSHIN_CRIU": str(no_leaks.criu),
           "BUNSHIN_TMPFS": str(no_leaks.tmpfs)}
    proc = subprocess.Popen([sys.executable, "-m", "bunshin.cli.main", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        yield Server(f"http://127.0.0.1:{port}", no_leaks.paths.server_token.read_text().strip(), proc.pid)
    finally:
        proc.terminate()
        proc.wait(60)


def _harbor():
    if importlib.util.find_spec("harbor") is None:  # the stand-in of harbor's interface, as test_harbor
        sys.path.insert(0, str(Path(__file__).parents[1] / "adapters" / "harbor_interface"))
    from bunshin.adapters import harbor

    return harbor


def test_a_sparse_file_read_through_every_path_costs_the_server_little(server, tmp_path):
    with Client(server.url, token=server.token) as c:
        ws = c.create(memory="256M")
        try:
            assert ws.exec(["sh", "-c", f"truncate -s {SPARSE} /root/sparse && truncate -s {2 * MAX_FILE_BYTES} "
                                        "/root/huge && du -k /root/sparse /root/huge"]).ok
            before = server.peak()
            files = f"{server.url}/v1/workspaces/{ws.id}/files/content"
            # the files API streams it: all of it arrives, the server holds a piece at a time
            got = 0
            with httpx.stream("GET", files, params={"path": "/root/sparse"}, headers=server.auth(),
                              timeout=300) as r:
                assert r.status_code == 200
                for piece in r.iter_bytes():
                    got += len(piece)
            assert got == SPARSE
            # over the whole-read cap: refused by name before a byte; a length reads that much only
            r = httpx.get(files, params={"path": "/root/huge"}, headers=server.auth(), timeout=60)
            assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
            assert "offset and length" in r.json()["hint"]
            assert len(ws.files.read("/root/huge", offset=MAX_FILE_BYTES, length=4096)) == 4096
            # the read_file tool reads what it shows, also for a line past the start of a file of no lines
            obs = httpx.post(f"{server.url}/v1/workspaces/{ws.id}/tools/read_file", headers=server.auth(),
                             json={"arguments": {"path": "/root/sparse"}}, timeout=120).json()
            assert obs["output"].endswith("read a line range]") and len(obs["output"]) < MAX_READ_BYTES + 100
            obs = httpx.post(f"{server.url}/v1/workspaces/{ws.id}/tools/read_file", headers=server.auth(),
                             json={"arguments": {"path": "/root/sparse", "start_line": 2}}, timeout=300).json()
            assert "has 1 lines" in (obs["error"] or ""), obs
            # SWE-ReX's read_file answers JSON text: over its cap it is refused by name
            r = httpx.post(f"{server.url}/swerex/{ws.id}/read_file", headers={"X-API-Key": server.token},
                           json={"path": "/root/sparse"}, timeout=120)
            assert r.status_code == 511 and f"{MAX_TEXT_FILE_BYTES >> 20} MiB" in r.json()["swerexception"]["message"]
            # an adapter's download (Harbor's) copies it out a piece at a time, and refuses past its cap
            harbor = _harbor()
            assert harbor._copy_out(ws, "/root/sparse", tmp_path / "copy", SPARSE) == SPARSE
            assert (tmp_path / "copy").stat().st_size == SPARSE
            with pytest.raises(harbor.ResourceExhausted, match="over"):
                harbor._copy_out(ws, "/root/sparse", tmp_path / "cut", SPARSE - 1)
            assert not (tmp_path / "cut").exists()
            grown = server.peak() - before
            print(f"\nserver peak (VmHWM) {before >> 20} MiB before, {(before + grown) >> 20} MiB after "
                  f"reading a {SPARSE >> 20} MiB sparse file through every path: +{grown >> 20} MiB")
            assert grown < GROWTH, f"the server grew by {grown >> 20} MiB"
        finally:
            ws.remove()


def test_bodies_and_numbers_out_of_range_are_refused_by_name(server):
    auth = server.auth()
    with Client(server.url, token=server.token) as c:
        ws = c.create(memory="256M")
        try:
            for body in ({"pids": 10**12}, {"pids": 1e12}, {"pids": 3}, {"count": 10**9}, {"memory": 10**30}):
                r = httpx.post(f"{server.url}/v1/workspaces", json=body, headers=auth, timeout=60)
                assert r.status_code in (400, 422) and r.json()["code"] == "invalid_argument", (body, r.text)
            r = httpx.post(f"{server.url}/v1/workspaces/{ws.id}/exec", headers=auth, timeout=60,
                           json={"command": ["true"], "max_output": 1 << 40})
            assert r.status_code == 422 and "max_output" in r.json()["message"], r.text
            big = b'{"command": ["true"], "stdin": "' + b"x" * (17 << 20) + b'"}'
            r = httpx.post(f"{server.url}/v1/workspaces/{ws.id}/exec", content=big, timeout=60,
                           headers={**auth, "Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text

            def chunked():  # no Content-Length: cut off once past the cap
                yield b'{"command": ["true"], "stdin": "'
                for _ in range(17):
                    yield b"x" * (1 << 20)
                yield b'"}'

            r = httpx.post(f"{server.url}/v1/workspaces/{ws.id}/exec", content=chunked(), timeout=60,
                           headers={**auth, "Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
            # a raw file body is no JSON: past 16 MiB it streams in; past MAX_FILE_BYTES it is refused unread
            files = f"{server.url}/v1/workspaces/{ws.id}/files/content"
            r = httpx.put(files, params={"path": "/root/twenty"}, content=b"z" * (20 << 20), headers=auth, timeout=60)
            assert r.status_code == 200 and r.json()["bytes"] == 20 << 20, r.text
            conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=60)
            conn.putrequest("PUT", f"/v1/workspaces/{ws.id}/files/content?path=/root/big")
            conn.putheader("Authorization", auth["Authorization"])
            conn.putheader("Content-Length", str(MAX_FILE_BYTES + 1))
            conn.endheaders()  # and no byte of the body
            answer = conn.getresponse()
            assert answer.status == 413 and json.loads(answer.read())["code"] == "payload_too_large"
            conn.close()
            assert not ws.exec(["test", "-e", "/root/big"]).ok
            assert c.get(ws.id).exec(["true"]).ok  # the server serves on
        finally:
            ws.remove()
