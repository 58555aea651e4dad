"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import psutil


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(values, 50), 3),
        "p95": round(percentile(values, 95), 3),
        "p99": round(percentile(values, 99), 3),
        "mean": round(statistics.fmean(values), 3) if values else float("nan"),
        "n": len(values),
    }


def system_used_bytes() -> int:
    """System-wide used memory as `free` computes it (total - available), tmpfs included.

    psutil's ``total`` and ``available`` are /proc/meminfo's MemTotal and MemAvailable.
    """
    vm = psutil.virtual_memory()
    return vm.total - vm.available
