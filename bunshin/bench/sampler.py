"""Memory over time, sampled in a background thread while a benchmark phase runs.

Two series, both honest about shared pages:

- ``used``: system-wide used memory (``MemTotal - MemAvailable``), which counts
  tmpfs memory files and page cache that cannot be reclaimed, every ~100 ms. This is
  the headline number; it also sees anything else running on the machine.
- ``ws``: what this bunshin home alone holds: the unreclaimable memory charged to its
  workspaces' memory cgroups (anonymous pages + tmpfs pages such as upper files, from
  ``memory.stat``; page cache that could be dropped is left out) plus the snapshot
  memory files and frozen layers on its tmpfs (written by the host, so charged to no
  workspace). A cross-check that other processes on the machine cannot disturb.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..runtime.container.cgroups import Layout
from .stats import system_used_bytes

GB = 1e9


@dataclass
class Series:
    t: list[float] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    ws: list[int] = field(default_factory=list)

    def peak(self, idle: int = 0) -> int:
        return max(self.used, default=idle) - idle

    def gb_s(self, idle: int = 0) -> float:
        return integral(self.t, [u - idle for u in self.used]) / GB

    def ws_peak(self) -> int:
        return max(self.ws, default=0)

    def ws_gb_s(self) -> float:
        return integral(self.t, self.ws) / GB

    def downsampled(self, points: int = 400) -> dict[str, list]:
        step = max(1, len(self.t) // points)
        return {"t": [round(x, 2) for x in self.t[::step]], "used": self.used[::step], "ws": self.ws[::step]}


def integral(t: Sequence[float], y: Sequence[float]) -> float:
    """Trapezoid rule; negative values (below idle) count as zero."""
    total = 0.0
    for i in range(1, len(t)):
        total += (t[i] - t[i - 1]) * (max(y[i], 0) + max(y[i - 1], 0)) / 2
    return total


def _tree_bytes(root: Path, skip: tuple[str, ...] = (), seen: set[tuple[int, int]] | None = None) -> int:
    """The blocks of the files under ``root``, each inode once (``seen``: inodes counted already, shared
    between calls): a memory file is linked from ``paths.mem`` and from every layer whose clones map it."""
    total = 0
    seen = set() if seen is None else seen
    if not root.is_dir():
        return 0
    for dirpath, dirnames, filenames in os.walk(root):
        if skip and dirpath == str(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(skip)]
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class HomeMemory:
    """Bytes held by one bunshin home: its workspace cgroups + its tmpfs snapshot files."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        layout = Layout.discover()
        self.version = layout.version
        self.bases = [h.base for h in layout.hierarchies if "memory" in h.controllers or layout.version == 2]
        self._files = 0
        self._n = 0

    def cgroups(self) -> int:
        keys = ("rss", "shmem") if self.version == 1 else ("anon", "shmem")
        total = 0
        for base in self.bases:
            try:
                entries = list(os.scandir(base))
            except OSError:
                continue
            for e in entries:
                if e.name.startswith(self.cfg.cgroup_prefix):
                    try:
                        with open(os.path.join(e.path, "memory.stat")) as f:
                            for line in f:
                                k, _, v = line.partition(" ")
                                if k in keys:
                                    total += int(v)
                    except (OSError, ValueError):
                        pass
        return total

    def files(self) -> int:
        seen: set[tuple[int, int]] = set()
        return (_tree_bytes(self.cfg.paths.mem, seen=seen)
                + _tree_bytes(self.cfg.paths.layers, skip=("agent-", "mask-"), seen=seen))

    def __call__(self) -> int:
        if self._n % 5 == 0:  # walking the layers is the slow part: every fifth sample
            self._files = self.files()
        self._n += 1
        return self.cgroups() + self._files


class MemorySampler:
    """``with MemorySampler(cfg) as s: ...``; then ``s.series`` (times from the start)."""

    def __init__(self, cfg: Config, interval: float = 0.1) -> None:
        self.interval = interval
        self.home = HomeMemory(cfg)
        self.series = Series()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-sampler", daemon=True)
        self._t0 = 0.0

    def _sample(self) -> None:
        self.series.t.append(time.perf_counter() - self._t0)
        self.series.used.append(system_used_bytes())
        self.series.ws.append(self.home())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> MemorySampler:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def idle_used(seconds: float = 1.0, interval: float = 0.1) -> int:
    """The median of system-wide used memory over ``seconds`` (the level a phase starts from)."""
    xs = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        xs.append(system_used_bytes())
        time.sleep(interval)
    xs.sort()
    return xs[len(xs) // 2]
