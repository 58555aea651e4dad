"""When the prefix cache snapshots, and what it keeps; the counters it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..speculate import SpeculationStats


@dataclass(frozen=True)
class CachePolicy:
    """Snapshot after a state-changing call slower than ``snapshot_min_s``, and at a
    node two trajectories reached (``snapshot_shared``) when replaying to it from
    the nearest snapshot would take at least ``shared_min_replay_s``. Snapshots
    are evicted, lowest *seconds saved per byte* first, to stay under
    ``memory_budget_bytes``. ``restore_cost_s`` is the first guess of what a fork
    from a snapshot costs (then measured), weighed against replaying calls.
    """

    snapshot_min_s: float = 1.0
    snapshot_shared: bool = True
    shared_min_replay_s: float = 0.25
    memory_budget_bytes: int = 4 << 30
    restore_cost_s: float = 0.3
    workers: int = 64  # threads for the (blocking) workspace API


@dataclass
class Counters:
    """The cache's running totals (``CacheStats`` reports them)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    materialisations: int = 0
    replayed: int = 0
    divergences: int = 0
    seconds_saved: float = 0.0
    replay_s: float = 0.0


@dataclass
class TrajectoryStats:
    calls: int = 0
    hits: int = 0
    misses: int = 0
    invalid: int = 0  # calls refused by argument checking
    uncached: int = 0  # calls run outside the tree (non-deterministic, timed out, detached)
    tool_s: float = 0.0  # summed latency of its calls
    seconds_saved: float = 0.0
    materialisations: int = 0
    replayed: int = 0
    replay_s: float = 0.0
    speculated_hits: int = 0


@dataclass(frozen=True)
class CacheStats:
    """``seconds_saved``: tool time the hits did not spend (original duration minus
    the hit's own latency); ``bytes_held``: snapshots the cache holds."""

    hits: int
    misses: int
    hit_rate: float
    seconds_saved: float
    bytes_held: int
    snapshots: int
    nodes: int
    trees: int
    evictions: int
    materialisations: int
    replayed_calls: int
    replay_s: float
    divergences: int
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
