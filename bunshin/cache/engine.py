"""The cache's engine: its trees, its workspaces and what it does with them.

``CacheEngine`` owns the state under :class:`~bunshin.cache.PrefixCache`: one tree per
task root, the live workspace handles, the policy, the counters and the background
tasks. Trajectories (``trajectory``) and speculations (``speculation``) use its
public methods: bring a workspace to a node (``materialise`` + ``replay``), run a
call, snapshot a state soon, evict, drop a workspace. It never calls up into them.

Everything is asyncio on one event loop. There is no global lock: a node being
computed carries a future that others wait on, and each workspace has its own lock
(the ``AsyncWorkspace``'s, see ``handles``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

from ..speculate import Predictor, SpeculationStats
from ..tools import Observation, ToolCall, ToolSet
from ..workspace.aio import AsyncSnapshot
from ..workspace.protocol import SnapshotAPI
from . import handles
from .policy import CachePolicy, CacheStats, Counters
from .tree import Node, Tree, WsHandle

log = logging.getLogger("bunshin.cache")


class Walker(Protocol):
    """What the engine and speculation see of a trajectory walking a tree."""

    @property
    def id(self) -> int: ...

    @property
    def node(self) -> Node | None:
        """Where it is (``None``: off the tree)."""
        ...

    @property
    def handle(self) -> WsHandle | None:
        """Its workspace, if it has one (it may lag behind ``node``)."""
        ...

    @property
    def calls(self) -> Sequence[ToolCall]:
        """Its checked calls on the tree path, oldest first."""
        ...

    async def close(self) -> None: ...


class CacheEngine:
    """Trees, workspaces, policy and counters of one cache; no I/O until used."""

    def __init__(self, tools: ToolSet, policy: CachePolicy, predictor: Predictor | None = None) -> None:
        self.tools = tools
        self.policy = policy
        self.predictor = predictor  # told about every call taken (speculation's)
        self.trees: dict[str, Tree] = {}
        self.handles: set[WsHandle] = set()
        self.walkers: set[Walker] = set()  # the open trajectories
        self.counters = Counters()
        self.epoch = 0
        self.restore_est = policy.restore_cost_s  # seconds a restore takes (measured)
        self.think_est: float | None = None  # the policies' think time between calls (measured)
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- trees ----------------------------------------------------------------------

    def tree(self, root: SnapshotAPI, key: str) -> Tree:
        """The tree named ``key``, made if new, with ``root`` as its root snapshot."""
        tree = self.trees.get(key)
        if tree is None:
            tree = self.trees[key] = Tree(key, None)
            tree.epoch = self.epoch
        held = tree.root.snapshot
        if held is None or held.sync is not root:
            tree.root.snapshot = AsyncSnapshot(root)
        return tree

    def new_iteration(self) -> None:
        self.epoch += 1
        for tree in self.trees.values():
            tree.epoch = self.epoch
        if self.predictor is not None:
            self.predictor.new_iteration()

    def held(self) -> list[Node]:
        """The nodes holding a snapshot the cache made (the roots are the caller's)."""
        return [n for t in self.trees.values() for n in t.nodes() if n.parent is not None and n.snapshot is not None]

    def stats(self, speculation: SpeculationStats | None = None) -> CacheStats:
        c = self.counters
        nodes = sum(1 for t in self.trees.values() for _ in t.nodes())
        held = self.held()
        calls = c.hits + c.misses
        return CacheStats(
            hits=c.hits, misses=c.misses, hit_rate=c.hits / calls if calls else 0.0,
            seconds_saved=round(c.seconds_saved, 3), bytes_held=sum(n.snapshot_bytes for n in held),
            snapshots=len(held), nodes=nodes - len(self.trees), trees=len(self.trees),
            evictions=c.evictions, materialisations=c.materialisations, replayed_calls=c.replayed,
            replay_s=round(c.replay_s, 3), divergences=c.divergences,
            speculation=speculation or SpeculationStats(),
        )

    # --- what trajectories tell it --------------------------------------------------

    def observe(self, prev: ToolCall | None, call: ToolCall, obs: Observation | None) -> None:
        """A trajectory took ``call`` after ``prev`` (the predictor learns from it)."""
        if self.predictor is not None and obs is not None:
            self.predictor.observe(prev, call, obs.duration_s)

    def note_think(self, seconds: float) -> None:
        est = self.think_est
        self.think_est = seconds if est is None else 0.9 * est + 0.1 * seconds

    # --- workspaces -----------------------------------------------------------------

    async def run(self, h: WsHandle, call: ToolCall) -> Observation:
        """Run one call in ``h``'s workspace (after what is queued there)."""
        return await handles.run_tool(self.tools, h, call)

    async def materialise(self, target: Node, *, own: WsHandle | None, take_parked: bool = True) -> WsHandle:
        """The cheapest workspace to bring to ``target``: ``own`` (replay), a parked
        fork on the path, or a restore of the deepest snapshot. Not yet replayed."""
        path = target.path()
        best, cost = None, math.inf
        if own is not None and own.node is not None and own.node.is_ancestor_of(target):
            best, cost = ("own", own.node), target.replay_cost(own.node)
        if take_parked:
            for n in reversed(path):
                if n.parked is not None and not n.parked.dead:
                    if target.replay_cost(n) < cost:
                        best, cost = ("parked", n), target.replay_cost(n)
                    break
        for n in reversed(path):
            if n.snapshot is not None:
                if self.restore_est + target.replay_cost(n) < cost:
                    best = ("snapshot", n)
                break
        assert best is not None, "the root always holds a snapshot"
        kind, node = best
        if kind == "own":
            assert own is not None
            return own
        if kind == "parked":
            return self.adopt(node)
        snap = node.snapshot
        assert snap is not None
        node.snapshot_busy += 1
        try:
            ws, seconds = await handles.restore(snap)
        finally:
            node.snapshot_busy -= 1
        node.snapshot_uses += 1
        self.restore_est = 0.8 * self.restore_est + 0.2 * seconds
        h = WsHandle(ws, node)
        self.handles.add(h)
        return h

    async def fork(self, own: WsHandle, target: Node, *, still: Callable[[], bool]) -> WsHandle | None:
        """A clone of ``own`` (at ``target``), if ``still()`` holds when its turn comes."""
        ws = await handles.fork_if(own, still)
        if ws is None:
            return None
        h = WsHandle(ws, target)
        self.handles.add(h)
        return h

    def adopt(self, node: Node) -> WsHandle:
        """Take the workspace parked at ``node`` (a finished speculation's fork)."""
        h = node.parked
        assert h is not None
        node.parked = None
        h.speculative = False
        return h

    async def replay(self, h: WsHandle, target: Node) -> tuple[int, float]:
        """Run the state-changing calls from ``h``'s node down to ``target`` in ``h``.

        On an observation that differs from the tree's, stop: ``h.node`` is then
        ``None`` (the workspace matches no node) and the divergence is counted.
        """
        assert h.node is not None
        count, seconds = 0, 0.0
        for n in target.steps_from(h.node):
            assert n.call is not None and n.obs is not None
            obs = await self.run(h, n.call)
            count += 1
            seconds += obs.duration_s
            self.counters.replayed += 1
            self.counters.replay_s += obs.duration_s
            if not obs.same_result(n.obs):
                self.counters.divergences += 1
                log.warning("replay of %s diverged from the cache: the tool is not deterministic", n.call.key)
                h.node = None
                return count, seconds
            h.node = n
            if n.want_snapshot and n.snapshot is None:
                await self.snapshot_soon(h, n)
        return count, seconds

    async def drop(self, h: WsHandle) -> None:
        """Forget ``h`` and remove its workspace once what runs in it is done."""
        self.handles.discard(h)
        if h.node is not None and h.node.parked is h:
            h.node.parked = None
        h.speculative = False
        await handles.discard(h)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background; ``aclose`` waits for it."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background cache task failed: %r", task.exception())

    # --- snapshots ------------------------------------------------------------------

    async def snapshot_soon(self, h: WsHandle, node: Node) -> None:
        """Snapshot ``h`` (which is at ``node``) in the background, before anything else runs in it."""
        if node.snapshot is not None or node.snapshotting or h.dead:
            return
        node.snapshotting = True
        self.spawn(self._snapshot(h, node))
        await asyncio.sleep(0)  # let it take its place in the workspace's queue: the next call waits for the dump

    async def _snapshot(self, h: WsHandle, node: Node) -> None:
        try:
            snap = await handles.snapshot_if(
                h, lambda: not h.dead and h.node is node and node.snapshot is None)
            if snap is None:
                return
            node.snapshot, node.snapshot_bytes, node.want_snapshot = snap, snap.size_bytes, False
        except Exception as exc:
            log.warning("snapshot at %r failed: %s", node, exc)
        finally:
            node.snapshotting = False
        await self.evict()

    async def maybe_snapshot_shared(self, node: Node) -> None:
        """Snapshot a node two trajectories reached, if replaying to it is not cheap."""
        p = self.policy
        if (not p.snapshot_shared or node.parent is None or node.snapshot is not None
                or node.snapshotting or node.reached < 2):
            return
        if node.replay_cost(node.nearest_snapshot(above=True)) < p.shared_min_replay_s:
            return
        for h in self.handles:
            if h.node is node and not h.dead and not h.busy:
                await self.snapshot_soon(h, node)
                return
        node.want_snapshot = True

    async def evict(self) -> None:
        """Drop snapshots, fewest seconds saved per byte first, until under the budget."""
        held = self.held()
        total = sum(n.snapshot_bytes for n in held)
        budget = self.policy.memory_budget_bytes
        if total <= budget:
            return

        def value(n: Node) -> float:
            saves = n.replay_cost(n.nearest_snapshot(above=True)) * (1 + n.snapshot_uses)
            return saves / max(n.snapshot_bytes, 1)

        for n in sorted((n for n in held if n.snapshot_busy == 0), key=value):
            if total <= budget:
                break
            snap, n.snapshot = n.snapshot, None
            total -= n.snapshot_bytes
            n.snapshot_bytes = 0
            self.counters.evictions += 1
            if snap is not None:
                await handles.remove_snapshot(snap)

    # --- closing --------------------------------------------------------------------

    async def aclose(self, *, keep_snapshots: bool = False) -> None:
        """Wait for the background tasks, remove every workspace and (unless
        ``keep_snapshots``) every snapshot the cache made. Call after the trajectories closed."""
        self.closed = True
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for h in list(self.handles):
            await self.drop(h)
        if not keep_snapshots:
            for node in self.held():
                snap, node.snapshot = node.snapshot, None
                if snap is not None:
                    await handles.remove_snapshot(snap)
