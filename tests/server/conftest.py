"""A real ``bunshin serve`` (uvicorn on a loopback port, in a thread) for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from bunshin.client import Client
from bunshin.config import Config
from bunshin.server.thread import serve_in_thread

TOKEN = "test-token-0123456789abcdef"


@dataclass
class Served:
    url: str
    token: str
    config: Config | None = None  # the home it serves

    def client(self, **kw: object) -> Client:
        return Client(self.url, token=self.token, **kw)  # type: ignore[arg-type]


@pytest.fixture
def served(no_leaks) -> Iterator[Served]:
    """The server over the test's private home; everything it made is checked by no_leaks."""
    with serve_in_thread(no_leaks, TOKEN) as url:
        yield Served(url, TOKEN, no_leaks)
