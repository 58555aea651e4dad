"""``PrefixCache``: tool results and workspace states, keyed by the calls since a task's root.

One tree per root snapshot (see ``tree``); trajectories walk it (see
``trajectory``); speculations fill it ahead of time (see ``speculation``).
Everything is asyncio on one event loop; the blocking workspace API runs in a
thread pool, serialised per workspace (``handles``). There is no global lock:
a node being computed carries a future that others wait on, and each workspace
has its own lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import StateConflict
from ..speculate import Call, SpeculationPolicy, SpeculationStats
from ..tools import Observation, ToolSet
from . import persist
from .handles import Host, WsHandle, snapshot_bytes
from .policy import CachePolicy, CacheStats
from .speculation import Speculator
from .trajectory import Trajectory
from .tree import Node, Tree

log = logging.getLogger("bunshin.cache")


class _Counters:
    def __init__(self) -> None:
        self.hits = self.misses = self.evictions = self.materialisations = 0
        self.replayed = self.divergences = 0
        self.seconds_saved = self.replay_s = 0.0


class PrefixCache:
    """A stateful tool prefix cache over workspaces of the given ``tools``.

    ``speculation``: run likely next calls early (``None``: never). Construction
    does no I/O; ``aclose()`` removes every workspace and snapshot the cache made
    (never the roots, which belong to the caller).
    """

    def __init__(self, tools: ToolSet, *, policy: CachePolicy | None = None,
                 speculation: SpeculationPolicy | None = None) -> None:
        self.tools = tools
        self.policy = policy or CachePolicy()
        self.host = Host(tools, self.policy.workers)
        self._trees: dict[str, Tree] = {}
        self._trajectories: set[Trajectory] = set()
        self._handles: set[WsHandle] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._counters = _Counters()
        self._epoch = 0
        self._next_id = 0
        self._restore_est = self.policy.restore_cost_s
        self._think_est: float | None = None  # the policies' think time between calls (measured)
        self._closed = False
        self.speculation = speculation
        self._speculator = Speculator(self, speculation) if speculation is not None else None

    # --- the API --------------------------------------------------------------------

    def start(self, root: Any, *, key: str | None = None) -> Trajectory:
        """A new trajectory from ``root`` (a Snapshot of the task's start).

        ``key`` names the tree (default: the root's id); give the same key to a new
        root snapshot of the same task to keep using a loaded tree.
        """
        if self._closed:
            raise StateConflict("the prefix cache is closed", hint="make a new PrefixCache")
        key = key or root.id
        tree = self._trees.get(key)
        if tree is None:
            tree = self._trees[key] = Tree(key, root)
            tree.epoch = self._epoch
        tree.root.snapshot = root
        self._next_id += 1
        traj = Trajectory(self, tree, self._next_id)
        self._trajectories.add(traj)
        self._after_call(traj)
        return traj

    def roots(self) -> dict[str, Any]:
        """The root snapshot of each tree, by tree key (after ``load``: the saved ones found)."""
        return {k: t.root.snapshot for k, t in self._trees.items() if t.root.snapshot is not None}

    def new_iteration(self) -> None:
        """Mark the start of a training iteration (predictors weigh this one's siblings first)."""
        self._epoch += 1
        for tree in self._trees.values():
            tree.epoch = self._epoch
        if self.speculation is not None:
            self.speculation.predictor.new_iteration()

    def stats(self) -> CacheStats:
        c = self._counters
        nodes = [n for t in self._trees.values() for n in t.nodes()]
        held = [n for n in nodes if n.parent is not None and n.snapshot is not None]
        calls = c.hits + c.misses
        return CacheStats(
            hits=c.hits, misses=c.misses, hit_rate=c.hits / calls if calls else 0.0,
            seconds_saved=round(c.seconds_saved, 3), bytes_held=sum(n.snapshot_bytes for n in held),
            snapshots=len(held), nodes=len(nodes) - len(self._trees), trees=len(self._trees),
            evictions=c.evictions, materialisations=c.materialisations, replayed_calls=c.replayed,
            replay_s=round(c.replay_s, 3), divergences=c.divergences,
            speculation=dataclasses.replace(self._speculator.stats) if self._speculator else SpeculationStats(),
        )

    def save(self, directory: str | Path, *, snapshots: bool = True) -> Path:
        """Write the trees (calls, observations, snapshot ids) to ``directory/tree.json``
        and, with ``snapshots``, every snapshot (roots too) to ``directory/snapshots/``.

        Without ``snapshots`` they stay only in bunshin's store: close with
        ``aclose(keep_snapshots=True)`` to hand them to a later ``load``.
        """
        return persist.save(self, Path(directory), snapshots=snapshots)

    @classmethod
    def load(cls, directory: str | Path, tools: ToolSet, *, config: Config | None = None,
             policy: CachePolicy | None = None, speculation: SpeculationPolicy | None = None,
             resolve: Callable[[str], Any] | None = None, trust: bool = False) -> PrefixCache:
        """A cache holding the trees saved in ``directory``.

        Each snapshot comes from bunshin's store (``config``) if it is still there,
        else from its saved folder; one found in neither is dropped. ``resolve``
        replaces that lookup (id -> Snapshot). The roots (``roots()``) belong to the
        caller, the other snapshots to the cache. Snapshot folders are untrusted input:
        only those this home saved load, unless ``trust`` (see ``Snapshot.load``).
        """
        cache = cls(tools, policy=policy, speculation=speculation)
        directory = Path(directory)
        persist.load(cache, directory, resolve or persist.store_resolver(config, directory, trust=trust))
        return cache

    async def aclose(self, *, keep_snapshots: bool = False) -> None:
        """Close every trajectory, cancel speculations, remove the workspaces and snapshots made."""
        if self._closed:
            return
        self._closed = True
        for traj in list(self._trajectories):
            await traj.close()
        if self._speculator is not None:
            await self._speculator.aclose()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for h in list(self._handles):
            await self._drop(h)
        if not keep_snapshots:
            for tree in self._trees.values():
                for node in tree.nodes():
                    if node.parent is not None and node.snapshot is not None:
                        snap, node.snapshot = node.snapshot, None
                        await self.host.remove_snapshot(snap)
        self.host.shutdown()

    async def __aenter__(self) -> PrefixCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- workspaces -----------------------------------------------------------------

    async def _materialise(self, target: Node, *, own: WsHandle | None, take_parked: bool = True) -> WsHandle:
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
                if self._restore_est + target.replay_cost(n) < cost:
                    best = ("snapshot", n)
                break
        assert best is not None, "the root always holds a snapshot"
        kind, node = best
        if kind == "own":
            assert own is not None
            return own
        if kind == "parked":
            return self._adopt(node)
        node.snapshot_busy += 1
        try:
            ws, seconds = await self.host.restore(node.snapshot)
        finally:
            node.snapshot_busy -= 1
        node.snapshot_uses += 1
        self._restore_est = 0.8 * self._restore_est + 0.2 * seconds
        h = WsHandle(ws, node)
        self._handles.add(h)
        return h

    def _adopt(self, node: Node) -> WsHandle:
        h = node.parked
        assert h is not None
        node.parked = None
        if self._speculator is not None:
            self._speculator.adopted(h)
        return h

    async def _replay(self, h: WsHandle, target: Node) -> tuple[int, float]:
        """Run the state-changing calls from ``h``'s node down to ``target`` in ``h``.

        On an observation that differs from the tree's, stop: ``h.node`` is then
        ``None`` (the workspace matches no node) and the divergence is counted.
        """
        assert h.node is not None
        count, seconds = 0, 0.0
        for n in target.steps_from(h.node):
            assert n.call is not None and n.obs is not None
            obs = await self.host.run_tool(h, n.call)
            count += 1
            seconds += obs.duration_s
            self._counters.replayed += 1
            self._counters.replay_s += obs.duration_s
            if not obs.same_result(n.obs):
                self._counters.divergences += 1
                log.warning("replay of %s diverged from the cache: the tool is not deterministic", n.call.key)
                h.node = None
                return count, seconds
            h.node = n
            if n.want_snapshot and n.snapshot is None:
                await self._snapshot_soon(h, n)
        return count, seconds

    async def _drop(self, h: WsHandle) -> None:
        self._handles.discard(h)
        if h.node is not None and h.node.parked is h:
            h.node.parked = None
        if self._speculator is not None:
            self._speculator.adopted(h)
        await self.host.discard(h)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background cache task failed: %r", task.exception())

    # --- snapshots ------------------------------------------------------------------

    async def _snapshot_soon(self, h: WsHandle, node: Node) -> None:
        """Snapshot ``h`` (which is at ``node``) in the background, before anything else runs in it."""
        if node.snapshot is not None or node.snapshotting or h.dead:
            return
        node.snapshotting = True
        await h.lock.acquire()  # taken now, released by the task: the next call waits for the dump
        self._spawn(self._snapshot_locked(h, node))

    async def _snapshot_locked(self, h: WsHandle, node: Node) -> None:
        try:
            if h.dead or h.node is not node or node.snapshot is not None:
                return
            snap = await self.host.call(h.ws.snapshot)
            node.snapshot, node.snapshot_bytes, node.want_snapshot = snap, snapshot_bytes(snap), False
        except Exception as exc:
            log.warning("snapshot at %r failed: %s", node, exc)
        finally:
            node.snapshotting = False
            h.lock.release()
        await self._evict()

    async def _maybe_snapshot_shared(self, node: Node) -> None:
        """Snapshot a node two trajectories reached, if replaying to it is not cheap."""
        p = self.policy
        if (not p.snapshot_shared or node.parent is None or node.snapshot is not None
                or node.snapshotting or node.reached < 2):
            return
        if node.replay_cost(node.nearest_snapshot(above=True)) < p.shared_min_replay_s:
            return
        for h in self._handles:
            if h.node is node and not h.dead and not h.lock.locked():
                await self._snapshot_soon(h, node)
                return
        node.want_snapshot = True

    async def _evict(self) -> None:
        """Drop snapshots, fewest seconds saved per byte first, until under the budget."""
        held = [n for t in self._trees.values() for n in t.nodes() if n.parent is not None and n.snapshot is not None]
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
            self._counters.evictions += 1
            await self.host.remove_snapshot(snap)

    # --- hooks from trajectories ----------------------------------------------------

    def _observe(self, traj: Trajectory, call: Call, obs: Observation | None) -> None:
        if self.speculation is not None and obs is not None:
            prev = traj._calls[-1] if traj._calls else None
            self.speculation.predictor.observe(prev, call, obs.duration_s)

    def _after_call(self, traj: Trajectory) -> None:
        if self._speculator is None or not traj.on_tree or self._closed:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # ``start()`` outside the event loop: speculate from the first call on
            return
        self._speculator.kick(traj)

    def _note_think(self, seconds: float) -> None:
        est = self._think_est
        self._think_est = seconds if est is None else 0.9 * est + 0.1 * seconds

    def _settle(self, traj: Trajectory, call: Call | None) -> None:
        if self._speculator is not None:
            self._speculator.settle(traj, call)

    def _speculator_used(self, child: Node, latency: float) -> None:
        if self._speculator is not None:
            self._speculator.used(child, latency)
