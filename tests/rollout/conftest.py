"""Where the rollout integration tests make their workspaces: this machine, or a
``bunshin serve`` host in this process reached over loopback HTTP (the engine runs
unchanged on remote workspaces, and the same tests must pass there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bunshin.client import Client
from bunshin.config import Config
from bunshin.server.thread import serve_in_thread
from bunshin.workspace import LocalHost
from bunshin.workspace.protocol import HostAPI

TOKEN = "rollout-test-token-0123456789"


@pytest.fixture(params=["local", "http"])
def host(request: pytest.FixtureRequest, no_leaks: Config) -> Iterator[HostAPI]:
    if request.param == "local":
        yield LocalHost(no_leaks)
        return
    with serve_in_thread(no_leaks, TOKEN) as url, Client(url, token=TOKEN) as client:
        yield client
