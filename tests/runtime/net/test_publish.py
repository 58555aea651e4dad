"""Ports in: a workspace port published on a host port, per workspace and per clone."""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import psutil
import pytest

from bunshin.errors import InvalidArgument, NotFound, ResourceExhausted, StateConflict
from bunshin.runtime.container import publish

# a server inside on 127.0.0.1 only: a forward from the host must arrive as a loopback client
SERVER = ("cd /srv && exec python3 -c 'import http.server as h; "
          "h.ThreadingHTTPServer((\"127.0.0.1\", 8000), h.SimpleHTTPRequestHandler).serve_forever()'")


def _serve(ws, text: str) -> None:
    assert ws.exec(["sh", "-c", f"mkdir -p /srv && printf '{text}' > /srv/who"]).ok
    ws.commands.spawn(["sh", "-c", SERVER])
    r = ws.exec(["python3", "-c", "import socket, time\nfor _ in range(300):\n try:\n"
                 "  socket.create_connection(('127.0.0.1', 8000), 1).close(); break\n"
                 " except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)"])
    assert r.exit_code == 0, r


def _get(p: publish.Published, path: str = "/who") -> str:
    return httpx.get(f"http://{p.address}{path}", timeout=10).text


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_parse_docker_forms():
    assert publish.parse("8000") == (8000, None, "127.0.0.1")
    assert publish.parse("8080:8000") == (8000, 8080, "127.0.0.1")
    assert publish.parse("0.0.0.0:8080:8000") == (8000, 8080, "0.0.0.0")
    assert publish.parse("127.0.0.1::8000") == (8000, None, "127.0.0.1")
    assert publish.parse("[::1]:8080:8000") == (8000, 8080, "::1")
    for bad in ("", "web:80", "80:", "a:b:c:d", "1:2:3:4"):
        with pytest.raises(InvalidArgument) as err:
            publish.parse(bad)
        assert "HOST_PORT:PORT" in err.value.hint


def test_a_workspace_publishes_at_most_max_published_ports(monkeypatch, tmp_path):
    from types import SimpleNamespace

    held = [publish.Published(port=80, host="127.0.0.1", host_port=1000 + i, pid=1) for i in range(publish.MAX_PUBLISHED)]
    monkeypatch.setattr(publish, "published", lambda cfg, ws_id: held)
    with pytest.raises(ResourceExhausted, match=f"{publish.MAX_PUBLISHED} ports published already"):
        publish.publish(SimpleNamespace(), SimpleNamespace(id="ws-0123456789ab", pid=None), 80)


def test_publish_per_workspace_and_per_clone(family):
    ws = family.create()
    _serve(ws, "parent")
    p = ws.publish(8000)
    assert p.host == "127.0.0.1" and p.host_port > 0 and _get(p) == "parent"
    assert ws.published() == [p]

    # the clone has the same server (forked) but no host port of its own until it asks;
    # a connection open through the published port at the fork stays the parent's
    held = socket.create_connection(("127.0.0.1", p.host_port), timeout=10)
    (clone,) = family.fork(ws, 1)
    with held:
        held.sendall(b"GET /who HTTP/1.0\r\n\r\n")
        assert held.makefile("rb").read().endswith(b"\r\n\r\nparent")
    assert clone.exec(["sh", "-c", "printf clone > /srv/who"]).ok
    assert clone.published() == []
    assert _get(p) == "parent"  # the parent's port still reaches the parent
    q = clone.publish(8000)
    assert q.host_port != p.host_port and _get(q) == "clone"

    # a workspace removed: its forwarder ends with it, the port closes; the parent's stays
    clone.remove()
    assert _gone(q.pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", q.host_port), timeout=5).close()
    assert _get(p) == "parent"

    # failures: clear errors, and the published port is untouched
    with pytest.raises(StateConflict) as err:
        ws.publish(8000, host_port=p.host_port)
    assert "in use" in err.value.message and err.value.hint
    for bad in ({"port": 0}, {"port": 70000}, {"port": 80, "host_port": -1}, {"port": 80, "host": "localhost"}):
        with pytest.raises(InvalidArgument):
            ws.publish(**bad)
    with pytest.raises(InvalidArgument) as err:
        ws.publish(80, host="192.0.2.254")  # not an address of this host (TEST-NET-1)
    assert "not an address of this host" in err.value.message

    # nothing listens on the port inside: the connection is closed, nothing hangs
    r = ws.publish(8001)
    with socket.create_connection(("127.0.0.1", r.host_port), timeout=5) as s:
        s.settimeout(5)
        assert s.recv(1) == b""
    ws.unpublish(r.host_port)
    assert _gone(r.pid) and ws.published() == [p]
    with pytest.raises(NotFound):
        ws.unpublish(r.host_port)
    assert _get(p) == "parent"


def test_a_stopped_workspace_cannot_publish(family):
    ws = family.create()
    rec = ws.record
    ws.remove()
    with pytest.raises(StateConflict) as err:
        publish.publish(family.cfg, rec, 8000)
    assert "not running" in err.value.message


def test_a_forwarder_serves_at_most_max_connections(family, monkeypatch):
    """Each connection is two host threads of the forwarder: one beyond the cap is closed."""
    from bunshin.runtime.container import forward

    ws = family.create()
    _serve(ws, "parent")
    listener = socket.create_server(("127.0.0.1", 0))
    pidfd = os.pidfd_open(ws.record.pid)
    monkeypatch.setattr(forward, "MAX_CONNECTIONS", 2)
    t = threading.Thread(target=forward.serve, args=(listener, pidfd, ws.record.pid, 8000), daemon=True)
    t.start()
    held = [socket.create_connection(listener.getsockname(), timeout=5) for _ in range(2)]
    try:
        time.sleep(0.5)  # both served (connected inside)
        with socket.create_connection(listener.getsockname(), timeout=5) as extra:
            extra.settimeout(5)
            assert extra.recv(1) == b""  # closed at once
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    with socket.create_connection(listener.getsockname(), timeout=5) as again:  # a slot is free again
        again.sendall(b"GET /who HTTP/1.0\r\n\r\n")
        again.settimeout(5)
        assert b"parent" in b"".join(iter(lambda: again.recv(4096), b""))
