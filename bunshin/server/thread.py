"""Listening sockets for ``bunshin serve``, and a server in a thread of this process
on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from ..config import Config
from ..errors import RuntimeFailure
from .admission import Limits
from .app import create_app
from .shares import SANDBOX_THREADS, THREADS


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket with ``TCP_NODELAY``, which the connections accepted on it inherit:
    without it a small answer waits for the peer's delayed ACK (~40 ms a call on loopback,
    measured by ``bunshin bench serve``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


@contextmanager
def serve_in_thread(config: Config, token: str, *, start_timeout: float = 10.0,
                    limits: Limits | None = None, default_ttl: float | None = None,
                    network: str = "none", network_default: str = "none", threads: int = THREADS,
                    sandbox_threads: int = SANDBOX_THREADS) -> Iterator[str]:
    """Serve ``config`` (within ``limits``, on a pool of ``threads``, ``sandbox_threads`` of
    them at most for one sandbox's E2B calls) until the block ends; yields the base URL
    (``http://127.0.0.1:PORT``)."""
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = create_app(config, token, limits=limits, default_ttl=default_ttl, network=network,
                     network_default=network_default, threads=threads, sandbox_threads=sandbox_threads)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bunshin-serve", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeFailure("the in-process server did not start", hint="see the log above")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
