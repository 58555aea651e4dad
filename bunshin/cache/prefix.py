"""``PrefixCache``: tool results and workspace states, keyed by the calls since a task's root.

The façade over the modules below it: one tree per root snapshot (``tree``) held by
the engine (``engine``, with its workspaces in ``handles``); trajectories walk it
(``trajectory``); speculations fill it ahead of time (``speculation``); ``persist``
saves and loads it. A call goes down that list, never back up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..config import Config
from ..errors import StateConflict
from ..speculate import SpeculationPolicy, SpeculationStats
from ..tools import ToolSet
from ..workspace.aio import default_bridge
from ..workspace.protocol import SnapshotAPI
from . import persist
from .engine import CacheEngine
from .policy import CachePolicy, CacheStats
from .speculation import Speculator
from .trajectory import Trajectory


class PrefixCache:
    """A stateful tool prefix cache over workspaces of the given ``tools``.

    ``speculation``: run likely next calls early (``None``: never). Construction
    does no I/O; ``aclose()`` removes every workspace and snapshot the cache made
    (never the roots, which belong to the caller). ``engine`` is the state under it.
    """

    def __init__(self, tools: ToolSet, *, policy: CachePolicy | None = None,
                 speculation: SpeculationPolicy | None = None) -> None:
        self.tools = tools
        self.policy = policy or CachePolicy()
        self.speculation = speculation
        default_bridge().resize(self.policy.workers)  # threads for the (blocking) workspace API
        self.engine = CacheEngine(tools, self.policy, speculation.predictor if speculation is not None else None)
        self._speculator = Speculator(self.engine, speculation) if speculation is not None else None
        self._next_id = 0

    # --- the API --------------------------------------------------------------------

    def start(self, root: SnapshotAPI, *, key: str | None = None) -> Trajectory:
        """A new trajectory from ``root`` (a Snapshot of the task's start).

        ``key`` names the tree (default: the root's id); give the same key to a new
        root snapshot of the same task to keep using a loaded tree.
        """
        if self.engine.closed:
            raise StateConflict("the prefix cache is closed", hint="make a new PrefixCache")
        tree = self.engine.tree(root, key or root.id)
        self._next_id += 1
        traj = Trajectory(self.engine, self._speculator, tree, self._next_id)
        self.engine.walkers.add(traj)
        if self._speculator is not None:
            self._speculator.kick(traj)
        return traj

    def roots(self) -> dict[str, SnapshotAPI]:
        """The root snapshot of each tree, by tree key (after ``load``: the saved ones found)."""
        return {k: t.root.snapshot.sync for k, t in self.engine.trees.items() if t.root.snapshot is not None}

    def new_iteration(self) -> None:
        """Mark the start of a training iteration (predictors weigh this one's siblings first)."""
        self.engine.new_iteration()

    def stats(self) -> CacheStats:
        spec = self._speculator
        return self.engine.stats(dataclasses.replace(spec.stats) if spec is not None else SpeculationStats())

    def save(self, directory: str | Path, *, snapshots: bool = True) -> Path:
        """Write the trees (calls, observations, snapshot ids) to ``directory/tree.json``
        and, with ``snapshots``, every snapshot (roots too) to ``directory/snapshots/``.

        Without ``snapshots`` they stay only in bunshin's store: close with
        ``aclose(keep_snapshots=True)`` to hand them to a later ``load``.
        """
        return persist.save(self.engine.trees.values(), Path(directory), snapshots=snapshots)

    @classmethod
    def load(cls, directory: str | Path, tools: ToolSet, *, config: Config | None = None,
             policy: CachePolicy | None = None, speculation: SpeculationPolicy | None = None,
             resolve: Callable[[str], SnapshotAPI] | None = None, trust: bool = False) -> PrefixCache:
        """A cache holding the trees saved in ``directory``.

        Each snapshot comes from bunshin's store (``config``) if it is still there,
        else from its saved folder; one found in neither is dropped. ``resolve``
        replaces that lookup (id -> Snapshot). The roots (``roots()``) belong to the
        caller, the other snapshots to the cache. Snapshot folders are untrusted input:
        only those this home saved load, unless ``trust`` (see ``Snapshot.load``).
        """
        cache = cls(tools, policy=policy, speculation=speculation)
        directory = Path(directory)
        resolve = resolve or persist.store_resolver(config, directory, trust=trust)
        for tree in persist.load(directory, resolve, cache.engine.predictor):
            cache.engine.trees[tree.key] = tree
        return cache

    async def aclose(self, *, keep_snapshots: bool = False) -> None:
        """Close every trajectory, cancel speculations, remove the workspaces and snapshots made."""
        if self.engine.closed:
            return
        self.engine.closed = True
        for traj in list(self.engine.walkers):
            await traj.close()
        if self._speculator is not None:
            await self._speculator.aclose()
        await self.engine.aclose(keep_snapshots=keep_snapshots)

    async def __aenter__(self) -> PrefixCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
