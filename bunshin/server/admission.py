"""Admission control: per-host caps and a create/fork rate, so a trainer cannot OOM the host.

Every call that makes workspaces (create, fork, restore) asks :meth:`Admission.admit`
first. Refused calls did nothing and answer :class:`~bunshin.errors.RateLimited`
(429, ``Retry-After``); :class:`bunshin.client.Client` waits and retries.

- ``max_workspaces``: live workspaces on the host (the store's records that are not
  dead, nor made ahead of their restore: ``runtime.snapshot.ahead``) plus those being made
  by calls in flight; read at each call with the sums below in SQL (no record parsed: 4.5
  ms for 1,000 workspaces, where parsing them took 37 ms);
- ``max_memory``: the sum of their memory limits (a workspace's cgroup ``memory.max``
  is the most it can take, so the sum bounds what they can take together), plus what the
  kept snapshots hold on bunshin's tmpfs, which is memory too (their memory files, images
  and layer: E2B templates and paused sandboxes, snapshots a caller kept): a workspace
  snapshotted and removed, or a sandbox paused, leaves its state in memory, and without
  this a caller could fill the host by pausing what it made. Under a memory cap a
  workspace without a limit is refused: it could take the whole host. ``bunshin serve``
  caps it at the host's memory unless told otherwise;
- ``max_pids``: the sum of their pids limits, the server's share of the host-wide
  pids budget (``runtime.budget``, which refuses past ``kernel.pid_max`` less 10% in
  any case, 507); here a refusal is a 429 to retry, counting calls in flight;
- ``reserve_memory``: what the host keeps for itself: while its available memory
  (``MemAvailable``, read at each call) is below this, nothing new is made. The caps
  above bound what workspaces may take; this one answers to what they did take
  (copy-on-write clones share their parent's pages, so their limits overstate them);
- ``rate`` / ``burst``: a token bucket of workspaces made per second, ``burst``
  at once; a batch larger than the bucket waits for a full bucket and takes it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil

from ..config import Config
from ..errors import InvalidArgument, RateLimited
from ..runtime import snapshot as rsnap
from ..runtime.state import budget
from ..runtime.state.store import Store

#: What a caller refused by a cap is told to wait: capacity frees when someone removes a workspace.
CAP_RETRY_S = 1.0


@dataclass(frozen=True)
class Limits:
    """``None``: no limit. ``max_memory`` in bytes; ``rate`` in workspaces per second."""

    max_workspaces: int | None = None
    max_memory: int | None = None
    reserve_memory: int | None = None
    rate: float | None = None
    burst: int = 8
    max_upload: int | None = None  # bytes of all uploads in flight together (``uploads.Uploads``)
    max_pids: int | None = None  # the sum of the workspaces' pids limits

    @classmethod
    def of_host(cls) -> Limits:
        """What ``bunshin serve`` caps by default: memory limits at the host's memory, pids at the
        host-wide budget, and 5% of the host's memory (at least 512 MiB) kept for the host."""
        total = psutil.virtual_memory().total
        return cls(max_memory=total, max_pids=budget.pids_budget(), reserve_memory=max(512 << 20, total // 20))

    def __post_init__(self) -> None:
        for name in ("max_workspaces", "max_memory", "reserve_memory", "max_upload", "max_pids"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise InvalidArgument(f"{name} must be >= 1, not {v}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise InvalidArgument(f"rate must be a positive number, not {self.rate}")
        if self.burst < 1:
            raise InvalidArgument(f"burst must be >= 1, not {self.burst}")


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved. Thread-safe."""

    def __init__(self, rate: float, burst: int) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Take ``min(n, burst)`` tokens: 0.0 if taken, else the seconds until they are there."""
        want = min(float(n), self._burst)
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
            self._at = now
            if self._tokens >= want:
                self._tokens -= want
                return 0.0
            return (want - self._tokens) / self._rate


class Admission:
    """The caps and the bucket of one server."""

    def __init__(self, config: Config, limits: Limits) -> None:
        self._config = config
        self.limits = limits
        self._bucket = TokenBucket(limits.rate, limits.burst) if limits.rate is not None else None
        self._lock = threading.Lock()
        self._pending_n = 0
        self._pending_mem = 0
        self._pending_pids = 0

    @contextmanager
    def admit(self, count: int, memory_each: int | None, pids_each: int | None = None) -> Iterator[None]:
        """Run the block if ``count`` more workspaces of ``memory_each`` bytes and ``pids_each``
        pids fit, else raise :class:`RateLimited`. They count as pending until the block ends
        (by then they are in the store, or were never made)."""
        lim = self.limits
        if lim.reserve_memory is not None:
            _check_host_memory(lim.reserve_memory)
        if lim.max_workspaces is None and lim.max_memory is None and lim.max_pids is None and self._bucket is None:
            yield
            return
        pids = (lim.max_pids if pids_each is None else pids_each) * count if lim.max_pids is not None else 0
        if lim.max_pids is not None and pids > lim.max_pids:
            raise InvalidArgument(f"{count} workspaces of {pids_each} pids never fit this host's cap of "
                                  f"{lim.max_pids} pids", hint="ask for fewer, or smaller pids limits")
        if lim.max_memory is not None and memory_each is None:
            raise InvalidArgument("this host caps the workspaces' total memory: a workspace needs a memory limit",
                                  hint="pass memory=, e.g. '1G'")
        mem = (memory_each or 0) * count
        if (lim.max_workspaces is not None and count > lim.max_workspaces) or \
                (lim.max_memory is not None and mem > lim.max_memory):
            raise InvalidArgument(f"{count} workspaces of {(memory_each or 0) >> 20} MiB never fit this host's caps "
                                  f"({lim.max_workspaces} workspaces, {(lim.max_memory or 0) >> 20} MiB)",
                                  hint="ask for fewer or smaller ones")
        with self._lock:
            self._check_caps(count, mem, pids)
            if self._bucket is not None and (wait := self._bucket.take(count)) > 0:
                raise RateLimited(f"over the create/fork rate ({lim.rate:g} workspaces/s, burst {lim.burst})",
                                  hint=f"retry in {wait:.2f} s", retry_after=math.ceil(wait * 100) / 100)
            self._pending_n += count
            self._pending_mem += mem
            self._pending_pids += pids
        try:
            yield
        finally:
            with self._lock:
                self._pending_n -= count
                self._pending_mem -= mem
                self._pending_pids -= pids

    def _check_caps(self, count: int, mem: int, pids: int) -> None:
        lim = self.limits
        with Store.open(self._config.db_path) as store:  # summed in SQL: no record parsed
            live = store.live_limits()
            kept = rsnap.kept_bytes(store) if lim.max_memory is not None else 0
        n = len(live) + self._pending_n
        if lim.max_workspaces is not None and n + count > lim.max_workspaces:
            raise RateLimited(f"{n} workspaces on this host; {count} more would pass its cap of "
                              f"{lim.max_workspaces}", hint="retry once some are removed",
                              retry_after=CAP_RETRY_S, cap="workspaces")
        if lim.max_memory is not None:
            limits = sum(m or 0 for m, _ in live) + self._pending_mem
            if limits + kept + mem > lim.max_memory:
                held = f" and kept snapshots hold {kept >> 20} MiB" if kept else ""
                raise RateLimited(f"the workspaces' memory limits add up to {limits >> 20} MiB{held}; {mem >> 20} "
                                  f"MiB more would pass this host's cap of {lim.max_memory >> 20} MiB",
                                  hint="retry once some are removed (paused sandboxes and kept snapshots count "
                                       "until they are removed), or ask for less memory",
                                  retry_after=CAP_RETRY_S, cap="memory")
        if lim.max_pids is not None:
            used = sum(lim.max_pids if p is None else p for _, p in live) + self._pending_pids
            if used + pids > lim.max_pids:
                raise RateLimited(f"the workspaces' pids limits add up to {used}; {pids} more would pass this "
                                  f"host's cap of {lim.max_pids}", hint="retry once some are removed, or ask "
                                  "for smaller pids limits", retry_after=CAP_RETRY_S, cap="pids")


def _check_host_memory(reserve: int) -> None:
    available = psutil.virtual_memory().available
    if available < reserve:
        raise RateLimited(f"this host has {available >> 20} MiB of memory available, under the "
                          f"{reserve >> 20} MiB it keeps for itself", retry_after=CAP_RETRY_S, cap="host_memory",
                          hint="retry once workspaces are removed (or their programs free memory)")
