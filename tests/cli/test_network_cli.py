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


@pytest.fixture
def cli(no_leaks, monkeypatch, capsys):
    """``bunshin`` in-process (the same parser and commands) over the test's home:
    ``cli(*argv)`` gives (exit code, stdout, stderr)."""
    from bunshin.cli.main import main

    monkeypatch.setenv("BUNSHIN_HOME", str(no_leaks.home))
    monkeypatch.setenv("BUNSHIN_CRIU", str(no_leaks.criu))
    monkeypatch.setenv("BUNSHIN_TMPFS", str(no_leaks.tmpfs))

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_publish_from_the_cli(no_leaks, cli):
    code, _, err = cli("create", "-p", "web:80")
    assert code == 125 and "HOST_PORT:PORT" in err
    # a separate `bunshin` process: the published port must outlive it
    made = json.loads(bunshin(no_leaks, "create", "--memory", "256M", "-p", "8000", "--json", *SERVER).stdout)
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
        assert json.loads(cli("port", made["id"], "--json")[1]) == [port]
        more = cli("port", made["id"], "-p", "127.0.0.1::8000", "--rm", str(port["host_port"]))[1]
        assert more.startswith("8000/tcp -> 127.0.0.1:") and f":{port['host_port']}\n" not in more
        code, _, err = cli("port", made["id"], "--rm", str(port["host_port"]))
        assert code == 125 and "not published" in err
        forwarders = [p for p in psutil.process_iter(["cmdline"]) if "bunshin.runtime.container.forward" in
                      " ".join(p.info["cmdline"] or []) and str(made["pid"]) in (p.info["cmdline"] or [])]
        assert len(forwarders) == 1
    finally:
        cli("rm", made["id"])
    assert psutil.wait_procs(forwarders, timeout=10)[1] == []  # it ends with the workspace


def test_network_from_the_cli(internet, cli):
    """create --network egress --allow/--deny, network show and set, and their errors."""
    from bunshin.cli import exits

    run = cli
    code, _, err = run("create", "--allow", "pypi.org")
    assert code == exits.FAILED and "--network egress" in err
    code, _, err = run("create", "--network", "egress", "--deny", "not a rule")
    assert code == exits.FAILED and "not a CIDR" in err
    code, out, _ = run("ls", "--json")
    assert json.loads(out) == []  # nothing was made
    code, out, err = run("create", "--memory", "256M", "--network", "egress", "--allow", internet.subnet,
                         "--deny", "192.0.2.99", "--json")
    assert code == 0, err
    ws = json.loads(out)["id"]
    try:
        code, out, _ = run("network", "show", ws, "--json")
        shown = json.loads(out)
        assert shown["network"] == "egress" and shown["allow"] == [internet.subnet] and shown["deny"] == ["192.0.2.99/32"]
        code, out, _ = run("network", "set", ws, "--deny", internet.other)
        assert code == 0 and f"deny: {internet.other}/32" in out and "allow" not in out
        code, _, err = run("network", "set", ws, "--allow", "x..y")
        assert code == exits.FAILED
        assert json.loads(run("network", "show", ws, "--json")[1])["deny"] == [f"{internet.other}/32"]
    finally:
        code, _, err = run("rm", ws)  # the batch removal frees its link, table and slot too (no_leaks)
    assert code == 0, err
