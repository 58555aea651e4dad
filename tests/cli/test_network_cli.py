"""Integration: `bunshin create -p` and `bunshin port`: published ports outlive the CLI call."""

from __future__ import annotations

import json
import time

import httpx
import psutil
import pytest

from tests.cli.test_cli import bunshin

pytestmark = pytest.mark.integration

SERVER = ["--", "python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/etc"]


def test_publish_from_the_cli(no_leaks):
    cfg = no_leaks
    bad = bunshin(cfg, "create", "-p", "web:80", check=False)
    assert bad.returncode == 125 and "HOST_PORT:PORT" in bad.stderr
    made = json.loads(bunshin(cfg, "create", "--memory", "256M", "-p", "8000", "--json", *SERVER).stdout)
    try:
        (port,) = made["ports"]
        assert port["port"] == 8000 and port["host"] == "127.0.0.1"
        for _ in range(200):  # the server inside is starting: connections are closed until it listens
            try:
                r = httpx.get(f"http://127.0.0.1:{port['host_port']}/hostname", timeout=10)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert r.status_code == 200 and r.text.strip()
        listed = json.loads(bunshin(cfg, "port", made["id"], "--json").stdout)
        assert listed == [port]
        more = bunshin(cfg, "port", made["id"], "-p", "127.0.0.1::8000", "--rm", str(port["host_port"])).stdout
        assert more.startswith("8000/tcp -> 127.0.0.1:") and f":{port['host_port']}\n" not in more
        gone = bunshin(cfg, "port", made["id"], "--rm", str(port["host_port"]), check=False)
        assert gone.returncode == 125 and "not published" in gone.stderr
        forwarders = [p for p in psutil.process_iter(["cmdline"]) if "bunshin.runtime.container.forward" in
                      " ".join(p.info["cmdline"] or []) and str(made["pid"]) in (p.info["cmdline"] or [])]
        assert len(forwarders) == 1
    finally:
        bunshin(cfg, "rm", made["id"])
    assert psutil.wait_procs(forwarders, timeout=10)[1] == []  # it ends with the workspace
