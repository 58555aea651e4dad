"""The server's one thread pool, and each sandbox's bounded share of it.

Blocking work of ``bunshin serve`` runs on anyio's thread pool of ``Limits.threads``
(``bunshin serve --threads``): plain routes (the control plane, the ``/v1`` API), uploads'
writes, E2B's data plane. A sandbox's data plane (envd, the code interpreter, the port
proxy: every call a client with its token makes) takes threads only through its share
(:meth:`Shares.run`): at most ``sandbox_threads`` at once; a call past them waits for one,
holding no thread; past ``MAX_WAITING`` calls waiting, the next is refused at once
(``RateLimited``: E2B's 429, the SDK's ``RateLimitException``). All sandboxes together hold
at most half the pool, so however many sandboxes are busy, the other half serves the control
plane and the ``/v1`` API; one sandbox's calls wait behind at most one share of every other
(the waits are first come, first served). A sandbox's share is made by its first call and
dropped with its last (nothing is kept for sandbox ids a client makes up). No stream of a
sandbox holds a thread for its life: a followed command, a watch, a code run or a download
polls in short calls, each taking a thread of the share (and, let in already, waiting its
turn rather than being refused); a forwarded request or websocket holds none once connected.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread

from ..errors import RateLimited
from .admission import CAP_RETRY_S

#: Threads of the server's pool (anyio's default is 40): each command, fork or session run
#: in flight holds one.
THREADS = 256
#: Threads one sandbox's data plane holds at once: its calls into the workspace take its lock
#: one at a time, so more would only wait on it.
SANDBOX_THREADS = 8
#: A sandbox's calls waiting for a thread of its share; the next is refused (429).
MAX_WAITING = 64
T = TypeVar("T")


class Offload(Protocol):
    """Runs a blocking call in a thread: ``await offload(fn, *args)`` (``anyio.to_thread.run_sync``,
    or a sandbox's share: ``functools.partial(shares.run, sandbox_id)``)."""

    def __call__(self, fn: Callable[..., T], /, *args: Any) -> Awaitable[T]: ...


@dataclass
class _Share:
    limiter: anyio.CapacityLimiter
    users: int = 0  # calls running or waiting


class Shares:
    """The sandboxes' shares of a pool of ``threads`` (see the module's docstring). Used on
    the server's event loop only (its limiters are made there, at first use)."""

    def __init__(self, threads: int = THREADS, sandbox_threads: int = SANDBOX_THREADS,
                 max_waiting: int = MAX_WAITING) -> None:
        self.threads = threads
        self.sandboxes = max(1, threads // 2)  # threads all sandboxes hold at once
        self.per_sandbox = max(1, min(sandbox_threads, self.sandboxes))
        self.max_waiting = max_waiting
        self._all: anyio.CapacityLimiter | None = None
        self._by: dict[str, _Share] = {}

    def start(self) -> None:
        """Size the event loop's thread pool (call from it, at the server's start)."""
        anyio.to_thread.current_default_thread_limiter().total_tokens = self.threads

    def __len__(self) -> int:
        """Sandboxes with calls running or waiting."""
        return len(self._by)

    @asynccontextmanager
    async def _share(self, sandbox_id: str) -> AsyncIterator[anyio.CapacityLimiter]:
        share = self._by.get(sandbox_id)
        if share is None:
            share = self._by[sandbox_id] = _Share(anyio.CapacityLimiter(self.per_sandbox))
        share.users += 1
        try:
            yield share.limiter
        finally:
            share.users -= 1
            if not share.users:
                del self._by[sandbox_id]

    async def run(self, sandbox_id: str, fn: Callable[..., T], *args: Any, refuse: bool = True) -> T:
        """``fn(*args)`` in a thread of ``sandbox_id``'s share, once one is free (waiting
        holds no thread); ``RateLimited`` if ``max_waiting`` of its calls wait already, unless
        ``refuse`` is false (a poll of a stream let in already, or a clean-up: bounded by
        the caps on streams, and never dropped)."""
        if self._all is None:
            self._all = anyio.CapacityLimiter(self.sandboxes)
        every = self._all
        async with self._share(sandbox_id) as own:
            if refuse and own.available_tokens < 1 and own.statistics().tasks_waiting >= self.max_waiting:
                raise RateLimited(
                    f"sandbox {sandbox_id} has {self.per_sandbox} calls running and {self.max_waiting} waiting: "
                    "no more are taken now", hint="retry when some have ended; make fewer calls at once",
                    retry_after=CAP_RETRY_S, cap="sandbox_threads")
            async with own, every:
                return await anyio.to_thread.run_sync(fn, *args)


__all__ = ["MAX_WAITING", "SANDBOX_THREADS", "THREADS", "Offload", "Shares"]
