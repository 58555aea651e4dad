"""What the rollout benchmark's workloads share: think times, the workload record."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ...rollout.policies import Trace
from ...rollout.task import TaskSpec

THINK_MEDIAN_S = 2.0  # a model's time to produce one tool call (median, before scaling)


def think(rng: random.Random, scale: float) -> float:
    """One recorded think time: log-normal around ``THINK_MEDIAN_S``, times ``scale``."""
    return round(min(THINK_MEDIAN_S * math.exp(rng.gauss(0.0, 0.5)), 4 * THINK_MEDIAN_S) * scale, 3)


@dataclass(frozen=True)
class Workload:
    """Tasks and the traces replayed against them (trace ``i`` of a task drives trajectory ``i``)."""

    name: str
    description: str
    tasks: list[TaskSpec]
    traces: list[Trace]
