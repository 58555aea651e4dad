"""The test internet itself: what the host reaches through its link, and that it goes away."""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import textwrap
import zipfile

import dns.resolver
import httpx
import pytest

from bunshin.bench.internet import Internet


def _link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_http_routes(internet):
    with httpx.Client(timeout=10) as http:
        assert http.get(internet.url("/files/hello.txt")).text == "hello from the test internet\n"
        body = http.get(internet.url("/bytes/70000")).content
        assert len(body) == 70000 and all(body[i] == i % 256 for i in (0, 255, 256, 65535, 65536, 69999))
        assert http.get(internet.url("/whoami", internet.other)).text == internet.host_addr
        assert http.get(internet.url("/files/../names.json")).status_code == 404
    seen = internet.wait_request("/bytes/70000")
    assert seen["sent"] == 70000 and seen["error"] is None and seen["client"] == internet.host_addr


def test_slow_download_is_paced_and_logs_a_reset(internet):
    path = "/slow/4000000?rate=262144"
    with httpx.Client(timeout=10) as http, http.stream("GET", internet.url(path)) as r:
        next(r.iter_raw(16384))
    # the client went away ~15 s early: the server's next writes meet a reset
    entry = internet.wait_request(path, timeout=10)
    assert entry["sent"] < 4000000 and entry["error"] in ("ConnectionResetError", "BrokenPipeError")


def test_dns_answers_configured_names_only(internet):
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers = [internet.dns]
    assert [a.to_text() for a in resolver.resolve("pypi.inet.test", "A")] == [internet.index]
    internet.add_name("*.zone.test", internet.other)
    assert [a.to_text() for a in resolver.resolve("any.zone.test", "A")] == [internet.other]
    with pytest.raises(dns.resolver.NXDOMAIN):
        resolver.resolve("elsewhere.test", "A")
    with pytest.raises(dns.resolver.NoAnswer):
        resolver.resolve("pypi.inet.test", "AAAA")
    assert [a.to_text() for a in resolver.resolve("web.inet.test", "A", tcp=True)] == [internet.web]
    internet.add_name("*.zone.test")
    with pytest.raises(dns.resolver.NXDOMAIN):
        resolver.resolve("any.zone.test", "A")
    assert {"pypi.inet.test", "elsewhere.test"} <= {q["name"] for q in internet.dns_queries()}


def test_the_index_serves_the_wheels_as_pep_503_says(internet):
    """Project pages link each wheel with its sha256 (pip installs from it: the headline
    test, tests/runtime/net/test_pip_install.py, does so inside a workspace)."""
    with httpx.Client(timeout=10) as http:
        assert "bunshin-netprobe-dep" in http.get(internet.index_url).text
        page = http.get(internet.index_url + "Bunshin_NetProbe/").text  # names are normalized
        href = re.search(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', page)
        assert href is not None, page
        wheel = http.get(internet.url(href[1], internet.index)).content
        assert hashlib.sha256(wheel).hexdigest() == href[2]
        with zipfile.ZipFile(io.BytesIO(wheel)) as whl:
            meta = whl.read("bunshin_netprobe-1.0.dist-info/METADATA").decode()
        assert "Requires-Dist: bunshin-netprobe-dep" in meta
        assert http.get(internet.index_url + "no-such-project/").status_code == 404


def test_a_dead_owner_leaves_nothing(tmp_path):
    """The process that made the internet dies without closing it: the servers exit,
    and the kernel removes the namespace, the link and the route."""
    code = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from bunshin.bench.internet import Internet
        inet = Internet.start(Path({str(tmp_path)!r})).__enter__()
        print(inet.link, inet.subnet, flush=True)
        os._exit(1)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    link, subnet = run.stdout.split()
    for _ in range(100):  # the servers see their stdin close, exit, and the namespace goes
        if not _link_exists(link):
            break
        subprocess.run(["sleep", "0.1"])
    assert not _link_exists(link)
    assert subnet not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout


def test_close_takes_everything_down(tmp_path):
    with Internet.start(tmp_path, dns=False) as inet:
        assert _link_exists(inet.link) and inet.dns is None
        with httpx.Client(timeout=10) as http:
            assert http.get(inet.url("/whoami")).status_code == 200
        proc = inet._proc
    # (no request after close: without the route it would leave by the default route)
    assert not _link_exists(inet.link) and proc.poll() is not None
    assert inet.subnet not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
