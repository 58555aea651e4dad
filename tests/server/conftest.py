"""A real ``bunshin serve`` (uvicorn on a loopback port, in a thread) for the HTTP tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from bunshin.client import Client
from bunshin.server import create_app

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Served:
    url: str
    token: str

    def client(self, **kw: object) -> Client:
        return Client(self.url, token=self.token, **kw)  # type: ignore[arg-type]


@pytest.fixture
def served(no_leaks) -> Iterator[Served]:
    """The server over the test's private home; everything it made is checked by no_leaks."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(no_leaks, TOKEN), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", TOKEN)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
