"""What the cache does to its workspaces and snapshots, through the async adapter.

Every call goes through the handle's :class:`~bunshin.workspace.aio.AsyncWorkspace`:
one bridge thread pool, one call at a time per workspace (its lock), so no tool call
is in flight while that workspace is snapshotted or forked (the dump would meet the
open connection). ``kill`` is the one exception: it removes the workspace under a
running call, which is how a speculation is cancelled.

``fork_if``/``snapshot_if`` check a condition on the tree when their turn in the
workspace's queue comes, in the bridge thread: the event loop changes what they read
only between calls into that workspace, so it holds for the whole dump.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import BunshinError
from ..tools import Observation, ToolCall, ToolSet
from ..workspace.aio import AsyncSnapshot, AsyncWorkspace
from ..workspace.protocol import SnapshotAPI, WorkspaceAPI
from .tree import WsHandle

log = logging.getLogger("bunshin.cache")
T = TypeVar("T")


async def _in(h: WsHandle, fn: Callable[..., T], /, *args: Any,
              undo: Callable[[T], object] | None = None, **kw: Any) -> T:
    """``fn(*args, **kw)`` under the workspace's lock, counted in ``h.busy``."""
    h.busy += 1
    try:
        return await h.ws.call(fn, *args, undo=undo, **kw)
    finally:
        h.busy -= 1


async def run_tool(tools: ToolSet, h: WsHandle, call: ToolCall) -> Observation:
    return await _in(h, tools.run_sync, h.ws.sync, call.name, call.arguments)


def _remove_made(obj: WorkspaceAPI | SnapshotAPI | None) -> None:
    if obj is not None:
        obj.remove()


async def fork_if(h: WsHandle, still: Callable[[], bool]) -> AsyncWorkspace | None:
    """A live clone of ``h``'s workspace, if ``still()`` holds when its turn comes."""
    ws = h.ws.sync

    def fork() -> WorkspaceAPI | None:
        if not still():
            return None
        (clone,) = ws.fork(1)
        return clone

    clone = await _in(h, fork, undo=_remove_made)
    return None if clone is None else AsyncWorkspace(clone, bridge=h.ws.bridge)


async def snapshot_if(h: WsHandle, still: Callable[[], bool]) -> AsyncSnapshot | None:
    """A snapshot of ``h``'s workspace, if ``still()`` holds when its turn comes."""
    ws = h.ws.sync

    def snapshot() -> SnapshotAPI | None:
        return ws.snapshot() if still() else None

    snap = await _in(h, snapshot, undo=_remove_made)
    return None if snap is None else AsyncSnapshot(snap, bridge=h.ws.bridge)


def _nothing() -> None:
    return None


async def settled(h: WsHandle) -> None:
    """Wait until what was queued in the workspace before now is done."""
    await _in(h, _nothing)


async def restore(snap: AsyncSnapshot) -> tuple[AsyncWorkspace, float]:
    """A new workspace in the snapshot's state, and the seconds that took."""
    t0 = time.perf_counter()
    (ws,) = await snap.restore(1)
    return ws, time.perf_counter() - t0


async def measure(h: WsHandle) -> int:
    """The workspace's own memory (USS), kept in ``h.bytes``; the last value if unknown."""
    with contextlib.suppress(BunshinError, OSError):
        st = await h.ws.stats()
        h.bytes = int(st.memory.uss_bytes)
    return h.bytes


@dataclass(frozen=True)
class Niceness:
    """What ``lower_priority`` changed, to put it back; the workspace's CPU seconds then."""

    nice: int
    cpu_s: float | None


async def _cpu_s(h: WsHandle) -> float | None:
    try:
        return (await h.ws.stats()).cpu_s
    except (BunshinError, OSError):
        return None


async def lower_priority(h: WsHandle, nice: int) -> Niceness | None:
    """Lower the CPU priority of the whole workspace (its cgroup's CPU weight: nothing
    inside its user namespace could raise a process's priority back)."""
    try:
        await _in(h, h.ws.sync.set_cpu_priority, nice)
    except BunshinError:
        return None
    return Niceness(nice, await _cpu_s(h))


async def restore_priority(h: WsHandle, n: Niceness) -> float | None:
    """Put the priority back; the CPU seconds the workspace used since ``lower_priority``."""
    try:
        await _in(h, h.ws.sync.set_cpu_priority, 0)
    except BunshinError:
        return None
    cpu = await _cpu_s(h)
    return None if cpu is None or n.cpu_s is None else max(cpu - n.cpu_s, 0.0)


async def discard(h: WsHandle) -> None:
    """Remove the workspace once whatever runs in it is done."""
    h.dead = True
    await _remove(h, wait=True)


async def kill(h: WsHandle) -> None:
    """Remove the workspace now, even under a running call (which then fails)."""
    h.dead = True
    await _remove(h, wait=False)


async def _remove(h: WsHandle, *, wait: bool) -> None:
    if h.removed:
        return
    h.removed = True
    try:
        await h.ws.remove(wait=wait)
    except Exception as exc:  # cleanup must go on; gc finds what is left
        log.warning("could not remove workspace %s: %s", h.ws.id, exc)


async def remove_snapshot(snap: AsyncSnapshot) -> None:
    try:
        await snap.remove()
    except Exception as exc:
        log.warning("could not remove snapshot %s: %s", snap.id, exc)
