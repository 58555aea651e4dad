"""Workspaces the cache drives, one call at a time each.

The workspace API blocks, so every operation runs in the cache's thread pool.
A ``WsHandle``'s lock serialises what the host does to one workspace: no tool
call may be in flight while that workspace is snapshotted or forked (the dump
would meet the open connection). ``kill`` is the one exception: it removes the
workspace under a running call, which is how a speculation is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BunshinError
from ..speculate import Call
from ..tools import Observation, ToolSet
from .tree import Node

log = logging.getLogger("bunshin.cache")
T = TypeVar("T")


class WsHandle:
    """A live workspace and the tree state (a state node) it is in."""

    def __init__(self, ws: Any, node: Node | None) -> None:
        self.ws = ws
        self.node = node  # None: in a state no node describes (a replay diverged)
        self.lock = asyncio.Lock()
        self.dead = False
        self.removed = False
        self.bytes = 0  # its own memory, when measured

    def __repr__(self) -> str:
        return f"WsHandle({getattr(self.ws, 'id', '?')!r} at {self.node!r})"


def snapshot_bytes(snap: Any) -> int:
    rec = getattr(snap, "record", None)
    return sum(int(getattr(rec, f, 0) or 0) for f in ("memfile_bytes", "image_bytes", "layer_bytes"))


# The CPU seconds of every process of a workspace but this shell (pid 1's too: it
# reaps the others' children): "T ticks hz".
_CPU_TICKS = r"""
T=0
for d in /proc/[0-9]*; do
  [ "${d#/proc/}" = "$$" ] && continue
  read -r l < "$d/stat" 2>/dev/null || continue
  set -- ${l##*) }
  T=$((T + $12 + $13 + $14 + $15))
done
echo "T $T $(getconf CLK_TCK 2>/dev/null || echo 100)"
"""


@dataclass(frozen=True)
class Niceness:
    """What ``nice_all`` changed, to put it back; ``cpu_s`` at that moment."""

    nice: int
    cpu_s: float | None


def _cpu_seconds(out: str) -> float | None:
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[0] == "T":
            with contextlib.suppress(ValueError, ZeroDivisionError):
                return int(f[1]) / int(f[2])
    return None


class Host:
    """Async, serialised access to workspaces and snapshots."""

    def __init__(self, tools: ToolSet, workers: int) -> None:
        self.tools = tools
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    async def call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="bunshin-cache")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def run_tool(self, h: WsHandle, call: Call) -> Observation:
        async with h.lock:
            return await self.call(self.tools.run_sync, h.ws, call.name, call.args)

    async def fork(self, h: WsHandle) -> Any:
        async with h.lock:
            (ws,) = await self.call(h.ws.fork, 1)
            return ws

    async def snapshot(self, h: WsHandle) -> Any:
        async with h.lock:
            return await self.call(h.ws.snapshot)

    async def restore(self, snap: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        (ws,) = await self.call(snap.restore, 1)
        return ws, time.perf_counter() - t0

    async def measure(self, h: WsHandle) -> int:
        with contextlib.suppress(BunshinError, OSError, AttributeError):
            st = await self.call(h.ws.stats)
            h.bytes = int(st.memory.uss_bytes)
        return h.bytes

    async def nice_all(self, h: WsHandle, nice: int) -> Niceness | None:
        """Lower the CPU priority of the whole workspace (its cgroup's CPU weight: nothing
        inside its user namespace could raise a process's priority back)."""
        async with h.lock:
            try:
                await self.call(h.ws.set_cpu_priority, nice)
                r = await self.call(h.ws.exec, ["/bin/sh", "-c", _CPU_TICKS], timeout=30)
            except BunshinError:
                return None
        return Niceness(nice, _cpu_seconds(r.stdout) if r.exit_code == 0 else None)

    async def unnice(self, h: WsHandle, n: Niceness) -> float | None:
        """Put the priority back; the CPU seconds used since ``nice_all``."""
        async with h.lock:
            try:
                await self.call(h.ws.set_cpu_priority, 0)
                r = await self.call(h.ws.exec, ["/bin/sh", "-c", _CPU_TICKS], timeout=30)
            except BunshinError:
                return None
        cpu = _cpu_seconds(r.stdout) if r.exit_code == 0 else None
        return None if cpu is None or n.cpu_s is None else max(cpu - n.cpu_s, 0.0)

    async def discard(self, h: WsHandle) -> None:
        """Remove the workspace once whatever runs in it is done."""
        h.dead = True
        async with h.lock:
            await self._remove(h)

    async def kill(self, h: WsHandle) -> None:
        """Remove the workspace now, even under a running call (which then fails)."""
        h.dead = True
        await self._remove(h)

    async def _remove(self, h: WsHandle) -> None:
        if h.removed:
            return
        h.removed = True
        try:
            await self.call(h.ws.remove)
        except Exception as exc:  # cleanup must go on; gc finds what is left
            log.warning("could not remove workspace %s: %s", getattr(h.ws, "id", "?"), exc)

    async def remove_snapshot(self, snap: Any) -> None:
        try:
            await self.call(snap.remove)
        except Exception as exc:
            log.warning("could not remove snapshot %s: %s", getattr(snap, "id", "?"), exc)
