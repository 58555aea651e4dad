"""A ``bunshin serve`` killed with -9 in the middle of a fork: restart it, the records are
there, the workspace it served still runs, and ``bunshin gc`` removes what the fork left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bunshin.client import Client
from bunshin.errors import BunshinError

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cfg, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu)}
    proc = subprocess.Popen([sys.executable, "-m", "bunshin.cli.main", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "server died"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)


def _bunshin(cfg, *args: str) -> str:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu)}
    return subprocess.run([sys.executable, "-m", "bunshin.cli.main", *args], env=env, check=True,
                          capture_output=True, text=True, timeout=120).stdout


def test_kill_9_mid_fork_then_restart_and_gc(no_leaks):
    cfg = no_leaks
    port = _free_port()
    server = _serve(cfg, port)
    token = Path(cfg.paths.server_token).read_text().strip()
    url = f"http://127.0.0.1:{port}"
    parent_id = None
    try:
        with Client(url, token=token) as c:
            ws = c.create(memory="1G")
            parent_id = ws.id
            ws.exec("echo kept > /tmp/mark", timeout=30)
            failed: list[BaseException] = []

            def fork() -> None:
                try:
                    ws.fork(8)
                except BunshinError as exc:
                    failed.append(exc)

            t = threading.Thread(target=fork)
            t.start()
            time.sleep(0.15)  # the fork is under way: paused, dumping or restoring
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
            t.join(30)
            assert failed, "the fork answered although its server was killed"

        server = _serve(cfg, port)
        with Client(url, token=token) as c:
            parent = c.get(parent_id)  # the record survived; the workspace still runs
            assert parent.exec("cat /tmp/mark", timeout=30).stdout == "kept\n"
        _bunshin(cfg, "gc")  # finishes the killed fork: its half-made clones and snapshot go
        with Client(url, token=token) as c:
            assert [w.id for w in c.list()] == [parent_id]
            c.get(parent_id).remove()
            assert c.list() == [] and c.snapshots() == []
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(10)


def test_sigterm_lets_calls_in_flight_finish_then_exits_keeping_everything(no_leaks):
    """Graceful shutdown: an exec under way when SIGTERM lands still answers; the server
    then exits, refuses new connections, and a restart serves the same workspace."""
    cfg = no_leaks
    port = _free_port()
    server = _serve(cfg, port)
    token = Path(cfg.paths.server_token).read_text().strip()
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url, token=token) as c:
            ws = c.create(memory="256M")
            ws.exec("echo kept > /tmp/mark", timeout=30)
            answers: list[object] = []
            t = threading.Thread(target=lambda: answers.append(ws.exec("sleep 2; echo drained", timeout=30)))
            t.start()
            time.sleep(0.5)  # the exec is in flight
            server.send_signal(signal.SIGTERM)
            t.join(30)
            assert [getattr(a, "stdout", a) for a in answers] == ["drained\n"]
            # uvicorn drains, runs the shutdown, then re-raises the signal it caught
            assert server.wait(30) in (0, -signal.SIGTERM)
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
        server = _serve(cfg, port)
        with Client(url, token=token) as c:
            again = c.get(ws.id)
            assert again.exec("cat /tmp/mark", timeout=30).stdout == "kept\n"
            again.remove()
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(10)
