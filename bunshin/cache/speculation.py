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

The ``Speculator`` runs on the engine (``engine``) and sees trajectories only as
``Walker`` objects; trajectories call it (``kick``, ``settle``, ``used``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ..speculate import ChildStat, PredictContext, SpeculationPolicy, SpeculationStats
from ..tools import ToolCall
from . import handles
from .engine import CacheEngine, Walker
from .tree import Node, WsHandle

log = logging.getLogger("bunshin.cache")


@dataclass(eq=False)
class Speculation:
    owner: Walker | None
    node: Node  # where it runs from
    child: Node  # the node it fills
    call: ToolCall
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

    def __init__(self, engine: CacheEngine, policy: SpeculationPolicy) -> None:
        self.engine = engine
        self.policy = policy
        self.stats = SpeculationStats()
        self._running: set[Speculation] = set()
        self._filling: dict[Node, Speculation] = {}  # the speculation that fills (or filled) a node
        self._launched: dict[Walker, list[Speculation]] = {}  # launched for a trajectory at its node
        self._avg_bytes = 0
        self.fork_est = 0.5  # seconds to get a fork in place (measured)

    # --- deciding -------------------------------------------------------------------

    def kick(self, walker: Walker) -> None:
        """Start speculations for a trajectory that now waits for its policy (from a
        running event loop; outside one, nothing starts)."""
        node = walker.node
        if node is None or self.policy.top_k <= 0 or self.engine.closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # ``start()`` outside the event loop: speculate from the first call on
            return
        think = self.engine.think_est
        if self.policy.think_aware and think is not None and think < self.fork_est:
            self.stats.skipped_think += 1
            return
        ctx = PredictContext(
            history=tuple(walker.calls),
            children=tuple(ChildStat(c.call, *c.taken()) for c in node.children.values()
                           if c.call is not None and c.obs is not None),
        )
        tools = self.engine.tools
        launched = 0
        for cand in self.policy.predictor.predict(ctx, self.policy.top_k):
            if launched >= self.policy.top_k:
                break
            call = cand.call
            if call.key in node.children or call.name not in tools:
                continue
            spec = tools.spec(call.name)
            if not spec.deterministic:
                continue
            if cand.expected_s is not None and cand.expected_s < self.policy.min_expected_s:
                continue
            if len(self._running) >= self.policy.max_concurrent or self._bytes() >= self.policy.max_memory_bytes:
                self.stats.skipped_budget += 1
                break
            self._launch(walker, node, call, spec.read_only)
            launched += 1

    def _bytes(self) -> int:
        return sum(h.bytes or self._avg_bytes for h in self.engine.handles if h.speculative and not h.dead)

    def _launch(self, walker: Walker, node: Node, call: ToolCall, read_only: bool) -> None:
        child = Node(node.tree, node, call, read_only)
        child.done = asyncio.get_running_loop().create_future()
        child.speculated = True
        node.children[call.key] = child
        s = Speculation(walker, node, child, call)
        log.debug("speculating %s for trajectory %s", call.key, walker.id)
        self._filling[child] = s
        self._launched.setdefault(walker, []).append(s)
        self._running.add(s)
        self.stats.started += 1
        s.task = self.engine.spawn(self._run(s))

    # --- running --------------------------------------------------------------------

    async def _source(self, s: Speculation) -> WsHandle | None:
        """A fork in the state of the speculation's node: of the owner's workspace when
        it is there (and no snapshot is), else the cheapest restore + replay."""
        target = s.node.state
        own = s.owner.handle if s.owner is not None else None
        if own is not None and own.node is target and not own.dead and target.snapshot is None:
            h = await self.engine.fork(own, target, still=lambda: (
                not s.cancelled and target.snapshot is None and own.node is target and not own.dead))
            if h is not None or s.cancelled:
                return h
        return await self.engine.materialise(target, own=None, take_parked=False)

    async def _run(self, s: Speculation) -> None:
        engine, child = self.engine, s.child
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
            h.speculative = True
            if s.cancelled:
                return
            if await handles.measure(h):
                self._avg_bytes = h.bytes if not self._avg_bytes else (self._avg_bytes + h.bytes) // 2
            niceness = await handles.lower_priority(h, self.policy.nice) if self.policy.nice else None
            await engine.replay(h, s.node.state)
            if h.node is not s.node.state or s.cancelled:
                return
            s.call_started = time.perf_counter()
            obs = await engine.run(h, s.call)
            s.run_s = obs.duration_s
            if niceness is not None:
                s.cpu_s = await handles.restore_priority(h, niceness)
            if s.cancelled or obs.timed_out:
                return
            # land: the result first, then the parked fork, then wake the waiters
            child.obs = obs
            s.finished = True
            h.node = child.state
            owner = s.owner
            if owner is not None and owner.node is s.node and child.state.parked is None:
                child.state.parked, keep = h, True
                if not s.child.read_only and obs.duration_s >= engine.policy.snapshot_min_s:
                    await engine.snapshot_soon(h, child)
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
                self._filling.pop(child, None)
            if h is not None and not keep:
                await engine.drop(h)

    # --- outcomes -------------------------------------------------------------------

    def used(self, child: Node, latency: float) -> None:
        """A real call took this node after waiting ``latency`` seconds (it counts if a
        speculation filled it)."""
        s = self._filling.pop(child, None)
        if s is None or s.used or child.obs is None:
            return
        s.used = True
        self.stats.used += 1
        self.stats.hidden_s += max(child.obs.duration_s - latency, 0.0)

    def settle(self, walker: Walker, call: ToolCall | None) -> None:
        """``walker`` makes ``call`` (``None``: it leaves its node or closes): its other
        speculations are no longer needed by it."""
        for s in self._launched.pop(walker, []):
            if call is not None and s.call.key == call.key and s.node is walker.node:
                continue
            self._unneeded(s)

    def _unneeded(self, s: Speculation) -> None:
        others = any(t is not s.owner and t.node is s.node for t in self.engine.walkers)
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
            parked.speculative = False
            self.engine.spawn(self.engine.drop(parked))

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
            self.engine.spawn(handles.kill(s.handle))

    async def aclose(self) -> None:
        for s in list(self._running):
            self._cancel(s)
        tasks = [s.task for s in list(self._running) if s.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        for h in [h for h in self.engine.handles if h.speculative]:
            await self.engine.drop(h)
