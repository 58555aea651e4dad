"""A trajectory: one agent's walk down the prefix tree.

While its calls hit, a trajectory is *virtual*: it moves from node to node and
holds no workspace. On its first miss it materialises one (the cheapest of:
replaying in the workspace it already has, adopting a speculation's finished
fork, or forking the deepest snapshot on its path) and replays only the
state-changing calls after that point. Its workspace may lag behind its node
(hits after a miss are served from the tree too); it is brought up to date only
when needed. Calls that cannot be cached (non-deterministic tools, timeouts)
take the trajectory off the tree: from then on it just runs its calls.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import StateConflict
from ..speculate import Call
from ..tools import Observation, ToolError, ToolSpec
from ..workspace.aio import AsyncWorkspace
from .handles import WsHandle
from .policy import TrajectoryStats
from .tree import Node, Tree

if TYPE_CHECKING:
    from .prefix import PrefixCache


@dataclass(frozen=True)
class Step:
    """One call of ``traj.history``."""

    name: str
    args: Any
    observation: Observation


class Trajectory:
    """Get one from ``PrefixCache.start(root)``; use ``call``, ``workspace``, ``close``."""

    def __init__(self, cache: PrefixCache, tree: Tree, tid: int) -> None:
        self.id = tid
        self.history: list[Step] = []
        self.stats = TrajectoryStats()
        self._cache = cache
        self._tree = tree
        self._node: Node | None = tree.root  # None once off the tree
        self._handle: WsHandle | None = None
        self._calls: list[Call] = []  # checked calls on the tree path, for the predictor
        self._specs: list[Any] = []  # speculations launched for us at our node
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

    # --- the API --------------------------------------------------------------------

    async def call(self, name: str, args: Any = None) -> Observation:
        """Run (or serve from the cache) one tool call; bad calls return an error observation."""
        if self._closed:
            raise StateConflict(f"trajectory {self.id} is closed")
        if self._busy:
            raise StateConflict(f"trajectory {self.id} is already running a call", hint="await each call")
        self._busy = True
        t0 = time.perf_counter()
        if self._answered_at is not None:
            self._cache._note_think(t0 - self._answered_at)
        try:
            obs = await self._call(name, args, t0)
        finally:
            self._busy = False
        self.stats.calls += 1
        self.stats.tool_s += time.perf_counter() - t0
        self.history.append(Step(name, args, obs))
        self._answered_at = time.perf_counter()
        self._cache._after_call(self)
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
        if self._handle is None:
            raise StateConflict(f"trajectory {self.id} lost its workspace", hint="start a new trajectory")
        async with self._handle.lock:  # let a background snapshot finish first
            return AsyncWorkspace(self._handle.ws)

    async def close(self) -> None:
        """Cancel its speculations and remove its workspace."""
        if self._closed:
            return
        self._closed = True
        self._cache._settle(self, None)
        self._cache._trajectories.discard(self)
        h, self._handle = self._handle, None
        if h is not None:
            await self._cache._drop(h)

    async def __aenter__(self) -> Trajectory:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- calls ----------------------------------------------------------------------

    async def _call(self, name: str, args: Any, t0: float) -> Observation:
        tools = self._cache.tools
        try:
            tool, checked = tools.check(name, args)
        except ToolError as exc:
            self.stats.invalid += 1
            return Observation("", None, exc.message, duration_s=time.perf_counter() - t0)
        call = Call(name, checked, tools.key(name, checked))
        self._cache._settle(self, call)
        if self._node is None:
            return await self._uncached(call, tool.spec)
        if not tool.spec.deterministic:
            await self._sync()
            obs = await self._uncached(call, tool.spec)
            if not tool.spec.read_only and not obs.timed_out:
                self._detach()
            return obs
        node = self._node
        while True:
            child = node.children.get(call.key)
            if child is None:
                return await self._miss(node, call, tool.spec)
            if child.obs is None and child.done is not None:
                child.waiters += 1
                try:
                    await asyncio.shield(child.done)
                finally:
                    child.waiters -= 1
            if child.obs is not None and node.children.get(call.key) is child:
                return await self._hit(child, call, t0)
            # it failed or was cancelled, and left the tree: look again

    async def _hit(self, child: Node, call: Call, t0: float) -> Observation:
        assert child.obs is not None
        latency = time.perf_counter() - t0
        self._advance(child, call)
        self.stats.hits += 1
        saved = max(child.obs.duration_s - latency, 0.0)
        self.stats.seconds_saved += saved
        self._cache._counters.hits += 1
        self._cache._counters.seconds_saved += saved
        if child.speculated:
            self.stats.speculated_hits += 1
        if child.speculation is not None:
            self._cache._speculator_used(child, latency)
        if child.state.parked is not None and self._handle is not child.state.parked:
            old, self._handle = self._handle, self._cache._adopt(child.state)
            self.stats.materialisations += 1
            self._cache._counters.materialisations += 1
            if old is not None:
                self._cache._spawn(self._cache._drop(old))
        await self._cache._maybe_snapshot_shared(child.state)
        return child.obs.as_cached(duration_s=latency, speculated=child.speculated)

    async def _miss(self, node: Node, call: Call, spec: ToolSpec) -> Observation:
        child = Node(self._tree, node, call, spec.read_only)
        child.done = asyncio.get_running_loop().create_future()
        node.children[call.key] = child
        landed = False
        try:
            await self._sync()
            if self._node is None:  # the replay diverged: off the tree from here on
                return await self._uncached(call, spec)
            assert self._handle is not None
            obs = await self._cache.host.run_tool(self._handle, call)
            self._cache._counters.misses += 1
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
            child.done.set_result(None)
            child.done = None
        self._handle.node = child.state
        self._advance(child, call)
        if not spec.read_only and (obs.duration_s >= self._cache.policy.snapshot_min_s or child.want_snapshot):
            await self._cache._snapshot_soon(self._handle, child)
        return obs

    async def _uncached(self, call: Call, spec: ToolSpec) -> Observation:
        """Run a call outside the tree, in this trajectory's own (current) workspace."""
        if self._handle is None:
            raise StateConflict(f"trajectory {self.id} has no workspace left", hint="start a new trajectory")
        try:
            obs = await self._cache.host.run_tool(self._handle, call)
        except BaseException:
            self._lose_handle()
            raise
        self.stats.uncached += 1
        if self._node is not None and spec.read_only:
            self._cache._observe(self, call, obs)
        return obs

    def _advance(self, child: Node, call: Call) -> None:
        self._cache._observe(self, call, child.obs)
        self._node = child
        self._calls.append(call)
        child.reach()

    def _detach(self) -> None:
        """Leave the tree (the workspace must be in sync, or about to be dropped)."""
        self._cache._settle(self, None)
        self._node = None

    def _lose_handle(self) -> None:
        """After a failed operation the workspace's state is unknown: let it go."""
        h, self._handle = self._handle, None
        if h is not None:
            self._cache._spawn(self._cache._drop(h))

    # --- materialising --------------------------------------------------------------

    async def _sync(self) -> None:
        """Bring (or get) a workspace in this trajectory's current state."""
        assert self._node is not None
        target = self._node.state
        h = self._handle
        if h is not None and h.node is target and not h.dead:
            return
        own = h if h is not None and not h.dead else None
        h = await self._cache._materialise(target, own=own)
        if h is not self._handle:
            if self._handle is not None:
                self._cache._spawn(self._cache._drop(self._handle))
            self._handle = h
            self.stats.materialisations += 1
            self._cache._counters.materialisations += 1
        try:
            replayed, seconds = await self._cache._replay(h, target)
        except BaseException:
            self._lose_handle()
            raise
        self.stats.replayed += replayed
        self.stats.replay_s += seconds
        if h.node is not target:  # the replay diverged: the tree does not describe this workspace
            self._detach()
