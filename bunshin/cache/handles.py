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


# For each process of a workspace but pid 1 (the agent) and this shell: add its CPU
# ticks to T (pid 1's too: it reaps the others' children), with the process's stat
# fields in $1... and its pid in $p. Each script below fills in ``{each}`` and ends
# with "T ticks hz".
_FOR_EACH_PROCESS = r"""
for d in /proc/[0-9]*; do
  p=${{d#/proc/}}
  [ "$p" = "$$" ] && continue
  read -r l < "$d/stat" 2>/dev/null || continue
  set -- ${{l##*) }}
  T=$((T + $12 + $13 + $14 + $15))
  [ "$p" = 1 ] && continue
{each}
done
echo "T $T $(getconf CLK_TCK 2>/dev/null || echo 100)"
"""

# Print "P pid nice" for each and set it to $1 when given.
_NICE = "N=$1; T=0" + _FOR_EACH_PROCESS.format(each=r"""
  echo "P $p ${17}"
  [ -n "$N" ] && renice -n "$N" -p "$p" >/dev/null 2>&1""")

# Put back the nice values "pid:nice ..." ($2...), $1 for processes not listed.
_UNNICE = 'D=$1; shift; M=" $* "; T=0' + _FOR_EACH_PROCESS.format(each=r"""
  n=$D
  case "$M" in *" $p:"*) n=${M#* $p:}; n=${n%% *};; esac
  [ "${17}" = "$n" ] || renice -n "$n" -p "$p" >/dev/null 2>&1""")


@dataclass(frozen=True)
class Niceness:
    """What ``nice_all`` changed, to put it back; ``cpu_s`` at that moment."""

    before: dict[int, int]
    default: int
    cpu_s: float | None


def _parse(out: str) -> tuple[dict[int, int], float | None]:
    procs: dict[int, int] = {}
    cpu = None
    for line in out.splitlines():
        f = line.split()
        if len(f) == 3 and f[0] == "P" and f[1].isdigit():
            with contextlib.suppress(ValueError):
                procs[int(f[1])] = int(f[2])
        elif len(f) == 3 and f[0] == "T":
            with contextlib.suppress(ValueError, ZeroDivisionError):
                cpu = int(f[1]) / int(f[2])
    return procs, cpu


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
        """Lower the CPU priority of every process in the workspace (not the agent)."""
        async with h.lock:
            try:
                r = await self.call(h.ws.exec, ["/bin/sh", "-c", _NICE, "nice", str(nice)], timeout=30)
            except BunshinError:
                return None
        if r.exit_code != 0:
            return None
        procs, cpu = _parse(r.stdout)
        return Niceness(procs, min(procs.values(), default=0), cpu)

    async def unnice(self, h: WsHandle, n: Niceness) -> float | None:
        """Put the priorities back; the CPU seconds used since ``nice_all``."""
        pairs = [f"{p}:{v}" for p, v in n.before.items()]
        async with h.lock:
            try:
                r = await self.call(h.ws.exec, ["/bin/sh", "-c", _UNNICE, "unnice", str(n.default), *pairs],
                                    timeout=30)
            except BunshinError:
                return None
        _, cpu = _parse(r.stdout)
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
