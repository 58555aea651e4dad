"""A trajectory: one agent's walk down the prefix tree.

While its calls hit, a trajectory is *virtual*: it moves from node to node and
holds no workspace. On its first miss it materialises one (the cheapest of:
replaying in the workspace it already has, adopting a speculation's finished
fork, or forking the deepest snapshot on its path) and replays only the
state-changing calls after that point. Its workspace may lag behind its node
(hits after a miss are served from the tree too); it is brought up to date only
when needed. Calls that cannot be cached (non-deterministic tools, timeouts)
take the trajectory off the tree: from then on it just runs its calls.

It drives the engine (``engine``) and the speculator (``speculation``), never the
other way round: to them it is a ``Walker``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import StateConflict
from ..tools import Observation, Step, ToolCall, ToolError, ToolSpec
from ..workspace.aio import AsyncWorkspace
from . import handles
from .engine import CacheEngine
from .policy import TrajectoryStats
from .speculation import Speculator
from .tree import Node, Tree, WsHandle


class Trajectory:
    """Get one from ``PrefixCache.start(root)``; use ``call``, ``workspace``, ``close``."""

    def __init__(self, engine: CacheEngine, speculator: Speculator | None, tree: Tree, tid: int) -> None:
        self.id = tid
        self.history: list[Step] = []
        self.stats = TrajectoryStats()
        self._engine = engine
        self._speculator = speculator
        self._tree = tree
        self._node: Node | None = tree.root  # None once off the tree
        self._handle: WsHandle | None = None
        self._calls: list[ToolCall] = []  # checked calls on the tree path, for the predictor
        self._busy = False
        self._closed = False
        self._answered_at: float | None = None  # when the last call returned (think time starts)
        tree.root.reach()

    def __repr__(self) -> str:
        return f"Trajectory({self.id}, depth={len(self._calls)}, {'on' if self.on_tree else 'off'} tree)"

    @property
    def on_tree(self) -> bool:
        return self._node is not None

    @property
    def node(self) -> Node | None:
        return self._node

    @property
    def handle(self) -> WsHandle | None:
        return self._handle

    @property
    def calls(self) -> Sequence[ToolCall]:
        """Its checked calls on the tree path, oldest first."""
        return self._calls

    # --- the API --------------------------------------------------------------------

    async def call(self, name: str, args: Mapping[str, Any] | str | None = None) -> Observation:
        """Run (or serve from the cache) one tool call; bad calls return an error observation."""
        if self._closed:
            raise StateConflict(f"trajectory {self.id} is closed")
        if self._busy:
            raise StateConflict(f"trajectory {self.id} is already running a call", hint="await each call")
        self._busy = True
        t0 = time.perf_counter()
        think = 0.0
        if self._answered_at is not None:
            think = t0 - self._answered_at
            self._engine.note_think(think)
        try:
            obs, call = await self._call(name, args, t0)
        finally:
            self._busy = False
        latency = time.perf_counter() - t0
        self.stats.calls += 1
        self.stats.tool_s += latency
        self.history.append(Step(self.stats.calls, think, call, obs, latency))
        self._answered_at = time.perf_counter()
        self._kick()
        return obs

    async def workspace(self) -> AsyncWorkspace:
        """This trajectory's workspace, brought up to date (materialised if needed).

        The trajectory then leaves the tree: what is done to the workspace directly
        is not recorded, so later calls run uncached. ``close()`` removes it.
        """
        if self._closed:
            raise StateConflict(f"trajectory {self.id} is closed")
        if self._node is not None:
            await self._sync()
            self._detach()
        h = self._handle
        if h is None:
            raise StateConflict(f"trajectory {self.id} lost its workspace", hint="start a new trajectory")
        await handles.settled(h)  # let a background snapshot finish first
        return h.ws

    async def close(self) -> None:
        """Cancel its speculations and remove its workspace."""
        if self._closed:
            return
        self._closed = True
        self._settle(None)
        self._engine.walkers.discard(self)
        h, self._handle = self._handle, None
        if h is not None:
            await self._engine.drop(h)

    async def __aenter__(self) -> Trajectory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- calls ----------------------------------------------------------------------

    async def _call(self, name: str, args: Mapping[str, Any] | str | None,
                    t0: float) -> tuple[Observation, ToolCall]:
        tools = self._engine.tools
        try:
            tool, checked = tools.check(name, args)
        except ToolError as exc:
            self.stats.invalid += 1
            obs = Observation("", None, exc.message, duration_s=time.perf_counter() - t0)
            return obs, ToolCall(name, _as_given(args))
        call = ToolCall(name, checked, key=tools.key(name, checked))
        self._settle(call)
        if self._node is None:
            return await self._uncached(call, tool.spec), call
        if not tool.spec.deterministic:
            await self._sync()
            obs = await self._uncached(call, tool.spec)
            if not tool.spec.read_only and not obs.timed_out:
                self._detach()
            return obs, call
        node = self._node
        while True:
            child = node.children.get(call.key)
            if child is None:
                return await self._miss(node, call, tool.spec), call
            if child.obs is None and child.done is not None:
                child.waiters += 1
                try:
                    await asyncio.shield(child.done)
                finally:
                    child.waiters -= 1
            if child.obs is not None and node.children.get(call.key) is child:
                return await self._hit(child, call, t0), call
            # it failed or was cancelled, and left the tree: look again

    async def _hit(self, child: Node, call: ToolCall, t0: float) -> Observation:
        assert child.obs is not None
        engine = self._engine
        latency = time.perf_counter() - t0
        self._advance(child, call)
        self.stats.hits += 1
        saved = max(child.obs.duration_s - latency, 0.0)
        self.stats.seconds_saved += saved
        engine.counters.hits += 1
        engine.counters.seconds_saved += saved
        if child.speculated:
            self.stats.speculated_hits += 1
        if self._speculator is not None:
            self._speculator.used(child, latency)
        if child.state.parked is not None and self._handle is not child.state.parked:
            old, self._handle = self._handle, engine.adopt(child.state)
            self.stats.materialisations += 1
            engine.counters.materialisations += 1
            if old is not None:
                engine.spawn(engine.drop(old))
        await engine.maybe_snapshot_shared(child.state)
        return child.obs.as_cached(duration_s=latency, speculated=child.speculated)

    async def _miss(self, node: Node, call: ToolCall, spec: ToolSpec) -> Observation:
        engine = self._engine
        child = Node(self._tree, node, call, spec.read_only)
        done = child.done = asyncio.get_running_loop().create_future()
        node.children[call.key] = child
        landed = False
        try:
            await self._sync()
            if self._node is None:  # the replay diverged: off the tree from here on
                return await self._uncached(call, spec)
            h = self._handle
            assert h is not None
            obs = await engine.run(h, call)
            engine.counters.misses += 1
            self.stats.misses += 1
            if obs.timed_out:  # the state after an interrupted command is anyone's guess
                self.stats.uncached += 1
                if not spec.read_only:
                    self._detach()
                return obs
            child.obs = obs
            landed = True
        except BaseException:
            self._lose_handle()
            raise
        finally:
            if not landed and node.children.get(call.key) is child:
                del node.children[call.key]
            done.set_result(None)
            child.done = None
        h.node = child.state
        self._advance(child, call)
        if not spec.read_only and (obs.duration_s >= engine.policy.snapshot_min_s or child.want_snapshot):
            await engine.snapshot_soon(h, child)
        return obs

    async def _uncached(self, call: ToolCall, spec: ToolSpec) -> Observation:
        """Run a call outside the tree, in this trajectory's own (current) workspace."""
        if self._handle is None:
            raise StateConflict(f"trajectory {self.id} has no workspace left", hint="start a new trajectory")
        try:
            obs = await self._engine.run(self._handle, call)
        except BaseException:
            self._lose_handle()
            raise
        self.stats.uncached += 1
        if self._node is not None and spec.read_only:
            self._engine.observe(self._prev(), call, obs)
        return obs

    def _prev(self) -> ToolCall | None:
        return self._calls[-1] if self._calls else None

    def _advance(self, child: Node, call: ToolCall) -> None:
        self._engine.observe(self._prev(), call, child.obs)
        self._node = child
        self._calls.append(call)
        child.reach()

    def _detach(self) -> None:
        """Leave the tree (the workspace must be in sync, or about to be dropped)."""
        self._settle(None)
        self._node = None

    def _lose_handle(self) -> None:
        """After a failed operation the workspace's state is unknown: let it go."""
        h, self._handle = self._handle, None
        if h is not None:
            self._engine.spawn(self._engine.drop(h))

    # --- speculation ----------------------------------------------------------------

    def _kick(self) -> None:
        """Speculate on its next call while its policy thinks."""
        if self._speculator is not None:
            self._speculator.kick(self)

    def _settle(self, call: ToolCall | None) -> None:
        if self._speculator is not None:
            self._speculator.settle(self, call)

    # --- materialising --------------------------------------------------------------

    async def _sync(self) -> None:
        """Bring (or get) a workspace in this trajectory's current state."""
        assert self._node is not None
        engine = self._engine
        target = self._node.state
        h = self._handle
        if h is not None and h.node is target and not h.dead:
            return
        own = h if h is not None and not h.dead else None
        h = await engine.materialise(target, own=own)
        if h is not self._handle:
            if self._handle is not None:
                engine.spawn(engine.drop(self._handle))
            self._handle = h
            self.stats.materialisations += 1
            engine.counters.materialisations += 1
        try:
            replayed, seconds = await engine.replay(h, target)
        except BaseException:
            self._lose_handle()
            raise
        self.stats.replayed += replayed
        self.stats.replay_s += seconds
        if h.node is not target:  # the replay diverged: the tree does not describe this workspace
            self._detach()


def _as_given(args: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The arguments of a call that failed checking, as they came (for ``history``)."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    return {"_unparsed": args}
