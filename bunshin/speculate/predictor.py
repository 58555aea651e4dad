"""Predicting a trajectory's next tool calls.

Calls are checked :class:`bunshin.tools.ToolCall` records (their ``key`` set). The
cache asks a ``Predictor`` for candidates while a trajectory waits for its
policy, and tells it about every call taken (``observe``) and every new training
iteration. ``FrequencyPredictor`` ranks:

1. the children of the trajectory's node in the prefix tree, by how often they
   were taken by its siblings in this iteration, then in earlier iterations;
2. then the calls that followed the same previous call anywhere, counted the
   same way; when that call was never made before (a new edit), the calls that
   followed the same *tool* instead: after an ``edit``, agents run the tests,
   whatever the edit was.

Candidates already in the tree are skipped by the cache, so in practice it is
the second source that finds work to do ahead of time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..tools.spec import ToolCall


@dataclass(frozen=True)
class ChildStat:
    """A child of the trajectory's node and how often it was taken."""

    call: ToolCall
    taken_now: int
    taken_before: int


@dataclass(frozen=True)
class PredictContext:
    history: Sequence[ToolCall]  # the trajectory's calls since the root, oldest first
    children: Sequence[ChildStat]  # the children of its node in the tree


@dataclass(frozen=True)
class Candidate:
    call: ToolCall
    score: float
    expected_s: float | None = None  # mean duration seen for this call, if any


@runtime_checkable
class Predictor(Protocol):
    def predict(self, ctx: PredictContext, k: int) -> list[Candidate]: ...

    def observe(self, prev: ToolCall | None, call: ToolCall, duration_s: float, *, weight: int = 1,
                earlier: bool = False) -> None: ...

    def new_iteration(self) -> None: ...


class _Counts:
    """Counts of next calls: this iteration's and earlier iterations'."""

    def __init__(self) -> None:
        self.now: dict[str, int] = defaultdict(int)
        self.before: dict[str, int] = defaultdict(int)

    def add(self, key: str, weight: int, earlier: bool) -> None:
        (self.before if earlier else self.now)[key] += weight

    def fold(self) -> None:
        for k, v in self.now.items():
            self.before[k] += v
        self.now.clear()

    def ranked(self) -> list[tuple[str, int, int]]:
        keys = set(self.now) | set(self.before)
        return sorted(((k, self.now.get(k, 0), self.before.get(k, 0)) for k in keys),
                      key=lambda t: (-t[1], -t[2], t[0]))


class FrequencyPredictor:
    """Children of the node by frequency, then follow-ups of the previous call."""

    def __init__(self, *, follow_ups: bool = True) -> None:
        self.follow_ups = follow_ups
        self._calls: dict[str, ToolCall] = {}
        self._by_key: dict[str, _Counts] = defaultdict(_Counts)
        self._by_tool: dict[str, _Counts] = defaultdict(_Counts)
        self._time: dict[str, tuple[float, int]] = {}

    def observe(self, prev: ToolCall | None, call: ToolCall, duration_s: float, *, weight: int = 1,
                earlier: bool = False) -> None:
        self._calls.setdefault(call.key, call)
        total, n = self._time.get(call.key, (0.0, 0))
        self._time[call.key] = (total + duration_s * weight, n + weight)
        self._by_key[prev.key if prev else ""].add(call.key, weight, earlier)
        self._by_tool[prev.name if prev else ""].add(call.key, weight, earlier)

    def new_iteration(self) -> None:
        for table in (self._by_key, self._by_tool):
            for counts in table.values():
                counts.fold()

    def expected_s(self, key: str) -> float | None:
        total, n = self._time.get(key, (0.0, 0))
        return total / n if n else None

    def predict(self, ctx: PredictContext, k: int) -> list[Candidate]:
        out: list[Candidate] = []
        seen: set[str] = set()

        def push(call: ToolCall, now: int, before: int, tier: int) -> None:
            if call.key not in seen:
                seen.add(call.key)
                out.append(Candidate(call, tier * 1e6 + now * 1e3 + before, self.expected_s(call.key)))

        for c in sorted(ctx.children, key=lambda c: (-c.taken_now, -c.taken_before, c.call.key)):
            push(c.call, c.taken_now, c.taken_before, 3)
        if self.follow_ups:
            prev = ctx.history[-1] if ctx.history else None
            # back off to what followed the same tool only for a call never made before
            # (it was observed once already: just now)
            if prev is None or self._time.get(prev.key, (0.0, 0))[1] > 1:
                counts, tier = self._by_key.get(prev.key if prev else ""), 2
            else:
                counts, tier = self._by_tool.get(prev.name), 1
            for key, now, before in counts.ranked() if counts is not None else ():
                push(self._calls[key], now, before, tier)
        out.sort(key=lambda c: -c.score)
        return out[: max(k, 0) * 4]  # a few spare: the cache skips what it already holds
