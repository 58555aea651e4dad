"""Integration: TCP connections inside a workspace, forked.

CRIU restores a connected socket in repair mode (``TCP_REPAIR``: CAP_NET_ADMIN over
the socket's network namespace). A workspace's network namespace is its user
namespace's, and a clone's is made by CRIU's restore inside the clone's user namespace
(``netns_image``), where the restorer holds that capability until it restores the
tasks' credentials. So a stream with data in flight (both queues full) goes on in the
parent and in every clone, every byte once and in order (tests/workspace/progs/
tcpstream.py: the server checks each counter and keeps a sha256); an idle pair keeps
working in both address families; a listening server takes new clients in a clone;
a fork of a fork carries the stream again. A pair with the largest buffers and both
windows full (``progs/tcpfull.py``) goes on with the parent's segment size.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.runtime.criu import netns_image

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"
TOTAL = 6_000_000  # ~2 s at the reader's pace
# a connected pair on loopback (IPv4 or IPv6), idle; on /tmp/ping the client sends "ping",
# and what the server receives goes to /tmp/pong
PAIR = r"""
import os, socket, sys, time
family, host = (socket.AF_INET6, "::1") if sys.argv[1] == "6" else (socket.AF_INET, "127.0.0.1")
lsk = socket.socket(family)
lsk.bind((host, 0))
lsk.listen(1)
client = socket.create_connection(lsk.getsockname()[:2])
server, _ = lsk.accept()
open("/tmp/pair.ready", "w").close()
while True:
    if os.path.exists("/tmp/ping"):
        os.unlink("/tmp/ping")
        client.sendall(b"ping")
        open("/tmp/pong", "w").write(server.recv(4).decode())
    time.sleep(0.02)
"""
# an echo server on 127.0.0.1:7007 (one thread per client) and one client that stays
# connected; /tmp/echo.ready when it listens
ECHO = r"""
import socket, threading
lsk = socket.socket()
lsk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lsk.bind(("127.0.0.1", 7007))
lsk.listen(8)
def serve(conn):
    while data := conn.recv(4096):
        conn.sendall(data)
held = socket.create_connection(("127.0.0.1", 7007))
open("/tmp/echo.ready", "w").close()
while True:
    conn, _ = lsk.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
CLIENT = ("import socket, sys; s = socket.create_connection(('127.0.0.1', 7007), timeout=10); "
          "s.sendall(sys.argv[1].encode()); print(s.recv(64).decode())")


def _wait_for(ws, path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while ws.exec(["test", "-e", path]).exit_code != 0:
        assert time.monotonic() < deadline, f"{path} did not appear in {ws.id}"
        time.sleep(0.05)


def _queues(ws) -> list[tuple[int, int]]:
    """(send queue, receive queue) bytes of each connected socket in the workspace."""
    out = []
    for line in ws.exec(["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]:  # (a file call may not read it)
        f = line.split()
        if f[3] == "01":
            tx, rx = f[4].split(":")
            out.append((int(tx, 16), int(rx, 16)))
    return out


def _result(ws, role: str = "") -> dict:
    try:
        _wait_for(ws, "/tmp/ts/result")
    except AssertionError as e:  # the stream stalled, or its processes are gone: what the namespace shows
        progress = ws.exec(["cat", "/tmp/ts/progress"]).stdout
        raise AssertionError(f"{role} {e}; progress {progress}\n{_post_mortem(ws)}") from None
    return json.loads(ws.files.read_text("/tmp/ts/result"))


def _start_stream(family):
    ws = family.create(memory="512M")
    ws.files.write("/root/tcpstream.py", (PROGS / "tcpstream.py").read_bytes())
    ws.exec(["mkdir", "-p", "/tmp/ts"])
    ws.commands.spawn(["python3", "/root/tcpstream.py", str(TOTAL), "/tmp/ts"])
    _wait_for(ws, "/tmp/ts/progress")
    queues = _queues(ws)
    assert any(tx > 0 for tx, _ in queues) and any(rx > 0 for _, rx in queues), queues  # data in flight
    return ws


def test_a_stream_in_flight_goes_on_in_the_parent_and_every_clone(family):
    ws = _start_stream(family)
    clones = family.fork(ws, 2)
    assert ws.exec(["test", "-e", "/tmp/ts/result"]).exit_code != 0, "the fork came before the stream's end"
    results = [_result(w) for w in (ws, *clones)]
    assert results[0] == {**results[0], "ok": True, "bytes": TOTAL, "error": None}
    assert results[1:] == [results[0]] * 2  # every byte once, in order: the same checksum
    for c in clones:  # /sys shows a live namespace's devices (the twin criu ran in)
        assert c.exec(["ls", "/sys/class/net"]).stdout.split() == ["lo"]


def test_a_fork_of_a_fork_carries_the_stream_again(family):
    ws = _start_stream(family)
    (child,) = family.fork(ws, 1)
    (grandchild,) = family.fork(child, 1)
    results = [_result(w, role) for w, role in ((ws, "parent"), (child, "child"), (grandchild, "grandchild"))]
    assert results[0]["ok"] and results == [results[0]] * 3


@pytest.mark.parametrize("version", ["4", "6"])
def test_an_idle_connection_works_in_the_parent_and_the_clone(family, version):
    ws = family.create(memory="256M")
    ws.files.write("/root/pair.py", PAIR.encode())
    ws.commands.spawn(["python3", "/root/pair.py", version])
    _wait_for(ws, "/tmp/pair.ready")
    (clone,) = family.fork(ws, 1)
    for w in (ws, clone):
        w.exec(["touch", "/tmp/ping"])
        _wait_for(w, "/tmp/pong")
        assert w.files.read_text("/tmp/pong") == "ping"


def test_a_listening_server_takes_new_clients_in_the_clone(family):
    ws = family.create(memory="256M")
    ws.files.write("/root/echo.py", ECHO.encode())
    ws.commands.spawn(["python3", "/root/echo.py"])
    _wait_for(ws, "/tmp/echo.ready")
    clones = family.fork(ws, 2)
    for i, w in enumerate((ws, *clones)):
        r = w.exec(["python3", "-c", CLIENT, f"hello-{i}"], timeout=30)
        assert r.exit_code == 0 and r.stdout.strip() == f"hello-{i}", r.stderr


def _start_full(ws, extra: int) -> dict:
    ws.files.write("/root/tcpfull.py", (PROGS / "tcpfull.py").read_bytes())
    ws.exec(["mkdir", "-p", "/tmp/tf"])
    ws.commands.spawn(["python3", "/root/tcpfull.py", "/tmp/tf", str(extra)])
    _wait_for(ws, "/tmp/tf/ready")
    return json.loads(ws.files.read_text("/tmp/tf/ready"))


def _go(ws) -> dict:
    ws.exec(["touch", "/tmp/tf/go"])
    _wait_for(ws, "/tmp/tf/result", timeout=60)
    return json.loads(ws.files.read_text("/tmp/tf/result"))


def _post_mortem(ws) -> str:
    """What a stalled pair's namespace shows: its sockets (``ss``), the TCP counters that are
    not zero (resets among them), its nftables ruleset (read from the host) and its processes."""
    sockets = ws.exec(["ss", "-tinmoeH"]).stdout
    lines = ws.exec(["cat", "/proc/net/netstat", "/proc/net/snmp"]).stdout.splitlines()  # (name, value) line pairs
    counters = {k: v for names, values in zip(lines[::2], lines[1::2], strict=True)
                for k, v in zip(names.split()[1:], values.split()[1:], strict=True) if v != "0"}
    rules = subprocess.run(["nsenter", "-t", str(ws.record.pid), "-n", "nft", "list", "ruleset"],
                           capture_output=True, text=True, timeout=30)
    procs = ws.exec(["sh", "-c", "for p in /proc/[0-9]*; do echo ${p#/proc/} $(readlink $p/ns/net) "
                     "$(cut -d' ' -f3 $p/stat) $(tr '\\0' ' ' < $p/cmdline); done"]).stdout
    errors = ws.exec(["sh", "-c", "cat /tmp/ts/error-* 2>/dev/null"]).stdout
    return (f"sockets:\n{sockets}\ncounters: {counters}\nnftables: {rules.stdout or rules.stderr!r}\n"
            f"errors: {errors!r}\n"
            f"processes (pid, network namespace, state, command):\n{procs}")


def _mss(ws) -> list[int]:
    """The MSS each connected socket of ``ws`` sends with (``ss -tin``)."""
    out = ws.exec(["ss", "-tinH", "state", "established"]).stdout
    return sorted(int(m) for m in re.findall(r"\bmss:(\d+)", out))


def test_a_pair_with_maximum_buffers_and_both_windows_full_goes_on_everywhere(family):
    """Both receive windows full with the largest buffers: the parent, every clone and a fork of
    a fork read every byte queued each way and more, in order, with the parent's segment size
    (CRIU alone restores the connection with the default MSS, 524 bytes on loopback instead of
    65,483: ``netns_image``)."""
    ws = family.create(memory="512M")
    queued = _start_full(ws, 4 << 20)
    assert queued["a_to_b"] > 4 << 20 and queued["b_to_a"] > 4 << 20, queued  # both ways full
    a, b = family.fork(ws, 2)
    (aa,) = family.fork(a, 1)
    res = _go(ws)
    assert res["ok"], res
    mss = _mss(ws)
    assert len(mss) == 2 and min(mss) > 1400, mss
    for w in (a, b, aa):
        res = _go(w)
        assert res["ok"], f"{w.id}: {res}\n{_post_mortem(w)}"
        assert res["a_to_b_bytes"] >= queued["a_to_b"] + (4 << 20), res
        assert _mss(w) == mss, w.id
        assert w.exec(["cat", "/sys/class/net/lo/mtu"]).stdout.strip() == str(netns_image.LO_MTU)  # as restored
