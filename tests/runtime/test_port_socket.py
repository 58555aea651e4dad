"""``Workspace.connect_port``: a TCP connection from the host into a workspace's own network
namespace (``runtime.container.port_socket``), on the real runtime."""

from __future__ import annotations

import os
import socket
import time

import pytest

from bunshin.errors import InvalidArgument, Unreachable

#: A one-line TCP echo-ish server inside the workspace: answers "in:<hostname>:<what it read>".
SERVER = ("import socket,os\n"
          "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('127.0.0.1', {port})); s.listen(4)\n"
          "while True:\n"
          "    c,_=s.accept(); d=c.recv(100); c.sendall(b'in:'+os.uname().nodename.encode()+b':'+d); c.close()\n")


def _wait_connect(ws, port: int):
    deadline = time.monotonic() + 10
    while True:
        try:
            return ws.connect_port(port)
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_connect_port_reaches_the_workspace_not_the_host(family) -> None:
    ws = family.create()
    port = 18123
    # a canary listener on the same port in the HOST's namespace: it must not be the one reached
    canary = socket.socket()
    canary.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    canary.bind(("127.0.0.1", port))
    canary.listen(1)
    canary.settimeout(0.2)
    ours = os.readlink("/proc/thread-self/ns/net")
    try:
        ws.commands.spawn(["python3", "-c", SERVER.format(port=port)])
        with _wait_connect(ws, port) as conn:
            conn.sendall(b"hello")
            answer = conn.recv(200)
        assert answer == f"in:{ws.record.hostname}:hello".encode()
        with pytest.raises(TimeoutError):
            canary.accept()  # nothing came to the host's listener
        assert os.readlink("/proc/thread-self/ns/net") == ours  # this thread never moved
    finally:
        canary.close()


def test_connect_port_refused_and_bad_ports(family) -> None:
    ws = family.create()
    with pytest.raises(Unreachable, match="nothing answers on port 18124"):
        ws.connect_port(18124)
    for bad in (0, 70000, -1, True):
        with pytest.raises(InvalidArgument):
            ws.connect_port(bad)
