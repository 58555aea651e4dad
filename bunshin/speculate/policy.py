"""The budget of speculative execution, and what it achieved."""

from __future__ import annotations

from dataclasses import dataclass, field

from .predictor import FrequencyPredictor, Predictor


@dataclass(frozen=True)
class SpeculationPolicy:
    """How much to run ahead of a trajectory.

    ``top_k`` candidates per waiting trajectory, at most ``max_concurrent``
    speculations at once holding at most ``max_memory_bytes`` of forks, each run
    at CPU priority ``nice``. Candidates expected to take less than
    ``min_expected_s`` are not worth a fork; with ``think_aware``, nothing is
    started while the trajectories' measured think time (between a call's answer
    and the next call) is shorter than a fork takes, since the real call would
    then wait for the fork. ``predictor`` defaults to a ``FrequencyPredictor``.
    """

    max_concurrent: int = 2
    max_memory_bytes: int = 2 << 30
    top_k: int = 2
    nice: int = 19
    min_expected_s: float = 0.5
    think_aware: bool = True
    predictor: Predictor = field(default_factory=FrequencyPredictor, compare=False)


@dataclass
class SpeculationStats:
    """``wasted_cpu_s``: CPU time of speculations nobody used (wall time where the
    workspace could not tell); ``hidden_s``: tool time taken off real calls."""

    started: int = 0
    used: int = 0
    cancelled: int = 0
    failed: int = 0
    skipped_budget: int = 0
    skipped_think: int = 0  # times the think time was too short for a fork
    wasted_cpu_s: float = 0.0
    hidden_s: float = 0.0
