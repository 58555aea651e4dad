"""Running predicted calls early, in forks, and landing their results in the tree.

After each call a trajectory waits for its policy; meanwhile the predictor's top
candidates that the tree does not hold yet run in forks of the trajectory's
state, at low CPU priority, within the policy's concurrency and memory budget.
A speculation occupies its node from the start (the node's ``done`` future), so
a real call of the same key waits for it instead of starting over. A finished
speculation leaves its fork *parked* at the new state: the trajectory that takes
that call adopts it and goes on without any replay. When the trajectory makes
another call, or closes, its other speculations are cancelled (forks removed),
unless another trajectory at that node may still want them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..speculate import Call, ChildStat, PredictContext, SpeculationPolicy, SpeculationStats
from .handles import WsHandle
from .tree import Node

if TYPE_CHECKING:
    from .prefix import PrefixCache
    from .trajectory import Trajectory

log = logging.getLogger("bunshin.cache")


@dataclass(eq=False)
class Speculation:
    owner: Trajectory | None
    node: Node  # where it runs from
    child: Node  # the node it fills
    call: Call
    task: asyncio.Task[None] | None = None
    handle: WsHandle | None = None
    call_started: float | None = None
    finished: bool = False
    cancelled: bool = False
    used: bool = False
    cpu_s: float | None = None
    run_s: float = 0.0


class Speculator:
    """The speculations of one cache."""

    def __init__(self, cache: PrefixCache, policy: SpeculationPolicy) -> None:
        self.cache = cache
        self.policy = policy
        self.stats = SpeculationStats()
        self._running: set[Speculation] = set()
        self._live: set[WsHandle] = set()  # forks held by speculations (running or parked)
        self._avg_bytes = 0
        self.fork_est = 0.5  # seconds to get a fork in place (measured)

    # --- deciding -------------------------------------------------------------------

    def kick(self, traj: Trajectory) -> None:
        """Start speculations for a trajectory that now waits for its policy."""
        node = traj.node
        if node is None or self.policy.top_k <= 0:
            return
        think = self.cache._think_est
        if self.policy.think_aware and think is not None and think < self.fork_est:
            self.stats.skipped_think += 1
            return
        ctx = PredictContext(
            history=tuple(traj._calls),
            children=tuple(ChildStat(c.call, *c.taken()) for c in node.children.values()
                           if c.call is not None and c.obs is not None),
        )
        launched = 0
        for cand in self.policy.predictor.predict(ctx, self.policy.top_k):
            if launched >= self.policy.top_k:
                break
            call = cand.call
            if call.key in node.children or call.name not in self.cache.tools:
                continue
            spec = self.cache.tools.spec(call.name)
            if not spec.deterministic:
                continue
            if cand.expected_s is not None and cand.expected_s < self.policy.min_expected_s:
                continue
            if len(self._running) >= self.policy.max_concurrent or self._bytes() >= self.policy.max_memory_bytes:
                self.stats.skipped_budget += 1
                break
            self._launch(traj, node, call, spec.read_only)
            launched += 1

    def _bytes(self) -> int:
        return sum(h.bytes or self._avg_bytes for h in self._live if not h.dead)

    def _launch(self, traj: Trajectory, node: Node, call: Call, read_only: bool) -> None:
        child = Node(node.tree, node, call, read_only)
        child.done = asyncio.get_running_loop().create_future()
        child.speculated = True
        node.children[call.key] = child
        s = Speculation(traj, node, child, call)
        log.debug("speculating %s for trajectory %s", call.key, traj.id)
        child.speculation = s
        traj._specs.append(s)
        self._running.add(s)
        self.stats.started += 1
        s.task = self.cache._spawn(self._run(s))

    # --- running --------------------------------------------------------------------

    async def _source(self, s: Speculation) -> WsHandle | None:
        """A fork in the state of the speculation's node: of the owner's workspace when
        it is there (and no snapshot is), else the cheapest restore + replay."""
        target = s.node.state
        own = s.owner.handle if s.owner is not None else None
        if own is not None and own.node is target and not own.dead and target.snapshot is None:
            async with own.lock:
                if s.cancelled:
                    return None
                if target.snapshot is None and own.node is target and not own.dead:
                    (ws,) = await self.cache.host.call(own.ws.fork, 1)
                    h = WsHandle(ws, target)
                    self.cache._handles.add(h)
                    return h
        return await self.cache._materialise(target, own=None, take_parked=False)

    async def _run(self, s: Speculation) -> None:
        host, child = self.cache.host, s.child
        h: WsHandle | None = None
        keep = False
        try:
            if s.cancelled:
                return
            t0 = time.perf_counter()
            h = await self._source(s)
            if h is None:
                return
            self.fork_est = 0.8 * self.fork_est + 0.2 * (time.perf_counter() - t0)
            s.handle = h
            self._live.add(h)
            if s.cancelled:
                return
            if await host.measure(h):
                self._avg_bytes = h.bytes if not self._avg_bytes else (self._avg_bytes + h.bytes) // 2
            niceness = await host.nice_all(h, self.policy.nice) if self.policy.nice else None
            await self.cache._replay(h, s.node.state)
            if h.node is not s.node.state or s.cancelled:
                return
            s.call_started = time.perf_counter()
            obs = await host.run_tool(h, s.call)
            s.run_s = obs.duration_s
            if niceness is not None:
                s.cpu_s = await host.unnice(h, niceness)
            if s.cancelled or obs.timed_out:
                return
            # land: the result first, then the parked fork, then wake the waiters
            child.obs = obs
            s.finished = True
            h.node = child.state
            owner = s.owner
            if owner is not None and owner.node is s.node and child.state.parked is None:
                child.state.parked, keep = h, True
                if not s.child.read_only and obs.duration_s >= self.cache.policy.snapshot_min_s:
                    await self.cache._snapshot_soon(h, child)
        except Exception as exc:
            if not s.cancelled:
                self.stats.failed += 1
                log.warning("speculation of %s failed: %r", s.call.key, exc)
        finally:
            self._running.discard(s)
            if child.obs is None and s.node.children.get(s.call.key) is child:
                del s.node.children[s.call.key]
            if child.done is not None:
                child.done.set_result(None)
                child.done = None
            if child.obs is None:
                child.speculation = None
            if h is not None and not keep:
                self._live.discard(h)
                await self.cache._drop(h)

    # --- outcomes -------------------------------------------------------------------

    def used(self, child: Node, latency: float) -> None:
        """A real call took this speculated node after waiting ``latency`` seconds."""
        s: Speculation | None = child.speculation
        child.speculation = None
        if s is None or s.used or child.obs is None:
            return
        s.used = True
        self.stats.used += 1
        self.stats.hidden_s += max(child.obs.duration_s - latency, 0.0)

    def adopted(self, h: WsHandle) -> None:
        """A speculation's fork became a trajectory's workspace (or was dropped)."""
        self._live.discard(h)

    def settle(self, traj: Trajectory, call: Call | None) -> None:
        """``traj`` makes ``call`` (``None``: it leaves its node or closes): its other
        speculations are no longer needed by it."""
        specs, traj._specs = traj._specs, []
        for s in specs:
            if call is not None and s.call.key == call.key and s.node is traj.node:
                continue
            self._unneeded(s)

    def _unneeded(self, s: Speculation) -> None:
        others = any(t is not s.owner and t.node is s.node for t in self.cache._trajectories)
        s.owner = None
        if not s.finished:
            if s.child.waiters or others:
                return  # someone may still take it: let it land (it will not park)
            self._cancel(s)
            return
        if not s.used:
            self.stats.wasted_cpu_s += s.cpu_s if s.cpu_s is not None else s.run_s
        parked = s.child.state.parked
        if parked is not None and parked is s.handle:
            s.child.state.parked = None
            self._live.discard(parked)
            self.cache._spawn(self.cache._drop(parked))

    def _cancel(self, s: Speculation) -> None:
        log.debug("cancelling %s (started: %s)", s.call.key, s.call_started is not None)
        s.cancelled = True
        self.stats.cancelled += 1
        if s.call_started is not None:
            self.stats.wasted_cpu_s += time.perf_counter() - s.call_started
        child = s.child
        if s.node.children.get(s.call.key) is child and child.obs is None:
            del s.node.children[s.call.key]
        if s.handle is not None:
            self.cache._spawn(self.cache.host.kill(s.handle))

    async def aclose(self) -> None:
        for s in list(self._running):
            self._cancel(s)
        tasks = [s.task for s in list(self._running) if s.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for h in list(self._live):
            self._live.discard(h)
            await self.cache._drop(h)
