"""``AsyncClient``: the same client, awaitable, through the one thread bridge.

There is one implementation of the wire (:class:`~bunshin.client.Client` and the
remote objects of :mod:`.remote`: request building, retries, idempotency keys, answer
parsing). ``AsyncClient`` runs its calls in :mod:`bunshin.workspace.aio`'s
:class:`~bunshin.workspace.aio.ThreadBridge` and hands out the workspaces and snapshots
as :class:`~bunshin.workspace.aio.AsyncWorkspace` / ``AsyncSnapshot`` over the remote
ones: the adapter the prefix cache, speculation and the rollout engine already use
for local workspaces, with the same guarantees (one call at a time per workspace;
cancelling a create, fork or restore removes what it made once it arrives).

A call waiting out a 429's Retry-After holds its bridge thread while it waits.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import httpx

from ..api import models as m
from ..workspace.aio import AsyncSnapshot, AsyncWorkspace, ThreadBridge, default_bridge
from .client import DEFAULT_URL, Client, Retry
from .remote import RemoteWorkspace

T = TypeVar("T")


def _remove_all(made: builtins.list[RemoteWorkspace]) -> None:
    for ws in made:
        ws.remove()


class AsyncClient:
    """A ``bunshin serve`` host for async code; the arguments are :class:`Client`'s.

    ``bridge``: the thread pool its blocking calls run in (default: the process's)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None,
                 token_file: str | Path | None = None, timeout: float | None = 300.0,
                 retry: Retry | None = None, transport: httpx.BaseTransport | None = None,
                 bridge: ThreadBridge | None = None) -> None:
        self._sync = Client(url, token=token, token_file=token_file, timeout=timeout, retry=retry,
                            transport=transport)
        self._bridge = bridge or default_bridge()

    @classmethod
    def from_env(cls) -> AsyncClient:
        """``BUNSHIN_URL`` (default the loopback port) and ``BUNSHIN_TOKEN``."""
        return cls(os.environ.get("BUNSHIN_URL", DEFAULT_URL))

    @property
    def sync(self) -> Client:
        """The blocking client underneath (use it only from a bridge thread)."""
        return self._sync

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._sync.url

    async def _run(self, fn: Callable[..., T], /, *args: Any, undo: Callable[[T], object] | None = None,
                   **kw: Any) -> T:
        return await self._bridge.run_sync(fn, *args, undo=undo, **kw)

    def _wrap(self, ws: RemoteWorkspace) -> AsyncWorkspace:
        return AsyncWorkspace(ws, bridge=self._bridge)

    async def health(self) -> m.Health:
        """The server's health: version, workspaces, limits."""
        return await self._run(self._sync.health)

    async def create(self, image: str = "host", *, name: str | None = None, memory: str | int | None = "2G",
                     pids: int | None = 512) -> AsyncWorkspace:
        """A new workspace on the server (``memory``, ``pids``: its limits)."""
        (ws,) = await self.create_many(1, image=image, name=name, memory=memory, pids=pids)
        return ws

    async def create_many(self, count: int, *, image: str = "host", name: str | None = None,
                          memory: str | int | None = "2G", pids: int | None = 512) -> builtins.list[AsyncWorkspace]:
        """``count`` new workspaces in one call; all of them or none."""
        made = await self._run(self._sync.create_many, count, image=image, name=name, memory=memory, pids=pids,
                               undo=_remove_all)
        return [self._wrap(ws) for ws in made]

    async def get(self, ref: str) -> AsyncWorkspace:
        """The server's workspace ``ref`` (an id or a name)."""
        return self._wrap(await self._run(self._sync.get, ref))

    async def list(self) -> builtins.list[m.WorkspaceOut]:
        """The server's workspaces."""
        return await self._run(self._sync.list)

    async def snapshot(self, ref: str) -> AsyncSnapshot:
        """The server's snapshot ``ref``."""
        return AsyncSnapshot(await self._run(self._sync.snapshot, ref), bridge=self._bridge)

    async def snapshots(self) -> builtins.list[AsyncSnapshot]:
        """The server's snapshots."""
        return [AsyncSnapshot(s, bridge=self._bridge) for s in await self._run(self._sync.snapshots)]

    async def aclose(self) -> None:
        """Close the connections (the server's workspaces stay)."""
        await self._run(self._sync.close)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncClient({self.url!r})"
