"""Where the next trajectory of a task runs: locality first, then room.

Pure decisions over :class:`HostLoad` records (no I/O), so the rule is tested alone
and its cost measured (``bunshin bench cluster``):

1. a live host that holds the task's root and has a free slot (the one with the most);
2. else a live host with a free slot, the root copied there first (a migration):
   the most free slots, then one whose store holds the task's image (none is moved),
   then the most free memory;
3. else (every host full) the live holder with the fewest trajectories: the call
   waits there for admission (429 + Retry-After), no copy is made;
4. no live host: :class:`~bunshin.errors.Unreachable`.

A host's slots are its ``max_workspaces`` (and ``max_memory`` over the task's memory
limit) minus the trajectories placed on it, and none while its free memory is under
its reserve plus one trajectory's estimate. A host without caps is bounded by memory only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..errors import Unreachable

#: What one trajectory is guessed to take when free memory is the bound (a fork shares
#: its root's pages: a few MiB until it writes; tools and sessions add some).
TRAJECTORY_ESTIMATE = 64 << 20


@dataclass(frozen=True)
class HostLoad:
    name: str
    alive: bool = True
    holds_root: bool = False
    running: int = 0  # trajectories placed there and not closed
    max_workspaces: int | None = None
    max_memory: int | None = None  # bytes of memory limits
    free_memory: int | None = None  # bytes available now (None: unknown, not a bound)
    reserve_memory: int = 0
    holds_image: bool = False  # its image store holds the task's image whole

    def slots(self, memory: int | None, estimate: int = TRAJECTORY_ESTIMATE) -> int | None:
        """Trajectories it may still take (``None``: no bound)."""
        bounds = []
        if self.max_workspaces is not None:
            bounds.append(self.max_workspaces - self.running)
        if self.max_memory is not None and memory:
            bounds.append(self.max_memory // memory - self.running)
        if self.free_memory is not None and self.free_memory < self.reserve_memory + estimate:
            bounds.append(0)
        return max(0, min(bounds)) if bounds else None


@dataclass(frozen=True)
class Choice:
    host: str
    migrate: bool  # the root must be copied there first
    queued: bool = False  # every host was full: it waits for admission there


@dataclass
class Plan:
    """Where a whole group goes: trajectories per host, and the hosts the root is copied to."""

    counts: dict[str, int] = field(default_factory=dict)
    migrations: list[str] = field(default_factory=list)
    queued: int = 0


def _room(load: HostLoad, memory: int | None) -> float:
    s = load.slots(memory)
    return float("inf") if s is None else float(s)


def choose(hosts: Sequence[HostLoad], *, memory: int | None = None, needs_root: bool = True) -> Choice:
    """The host for one more trajectory (``needs_root``: it forks from the task's root;
    off in baseline mode, where every host is as good as its room)."""
    live = [h for h in hosts if h.alive]
    if not live:
        raise Unreachable("no live host in the cluster", hint="see `bunshin cluster status`; "
                                                              "`bunshin cluster up` restarts missing hosts")

    def key(h: HostLoad) -> tuple[float, bool, int, str]:
        return (-_room(h, memory), not h.holds_image, -(h.free_memory or 0), h.name)

    open_ = [h for h in live if _room(h, memory) > 0]
    if not needs_root:
        if open_:
            return Choice(min(open_, key=key).name, migrate=False)
        return Choice(min(live, key=lambda h: (h.running, h.name)).name, migrate=False, queued=True)
    holders = [h for h in open_ if h.holds_root]
    if holders:
        return Choice(min(holders, key=key).name, migrate=False)
    if open_:
        return Choice(min(open_, key=key).name, migrate=True)
    full_holders = [h for h in live if h.holds_root] or live
    best = min(full_holders, key=lambda h: (h.running, h.name))
    return Choice(best.name, migrate=not best.holds_root, queued=True)


def plan(hosts: Sequence[HostLoad], n: int, *, memory: int | None = None, needs_root: bool = True) -> Plan:
    """``n`` trajectories placed one after the other, each seeing the ones before it."""
    loads = {h.name: h for h in hosts}
    out = Plan()
    for _ in range(n):
        c = choose(list(loads.values()), memory=memory, needs_root=needs_root)
        h = loads[c.host]
        if c.migrate:
            out.migrations.append(c.host)
        out.queued += c.queued
        loads[c.host] = replace(h, running=h.running + 1, holds_root=h.holds_root or needs_root)
        out.counts[c.host] = out.counts.get(c.host, 0) + 1
    return out
