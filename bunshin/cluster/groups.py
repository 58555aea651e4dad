"""The HTTP API's groups over the cluster: a group key's trajectories placed on its hosts.

``ClusterGroups(placement).join(key=..., n=..., task=...)`` places this caller's ``n``
trajectories with the scheduler (hosts whose server already holds the key first, then
room: ``max_workspaces`` minus the key's open trajectories or the live workspaces
there, whichever is more) and joins the key on each host chosen (``POST /v1/groups``);
each host's group has its own prefix cache. Where a key lives is asked of the hosts
(``GET /v1/groups/{key}``), so callers in other processes place theirs next to it too.

A host that does not hold the key yet gets a copy of a holder's root (save -> transfer
-> load, through the head's spool) and joins with that snapshot *and* the task: the
task's setup does not run again there, and its tools and reward apply. Only the first
host builds the root from the task. The copies are this object's to free
(:meth:`ClusterGroups.remove`; the groups do not own them), and leased to its head
(:mod:`bunshin.cluster.copies`): a head that dies leaves them to run out on their hosts.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..api.groups import GroupOut
from ..client.groups import RemoteGroup, RemoteTrajectory, TaskLike
from ..errors import NotFound, StateConflict
from .images import ImageMove
from .placement import ClusterPlacement
from .scheduler import HostLoad, choose


@dataclass(frozen=True)
class Share:
    """This caller's trajectories of a key on one host."""

    host: str
    group: RemoteGroup
    image: ImageMove | None = None  # the task's image moved to this host for it


class ClusterGroups:
    def __init__(self, placement: ClusterPlacement) -> None:
        self.placement = placement
        self.copies: dict[tuple[str, str], str] = {}  # (key, host) -> the root copy loaded there

    def holders(self, key: str) -> set[str]:
        """The live hosts whose server holds the group ``key``."""
        return set(self._groups(key))

    def _groups(self, key: str) -> dict[str, GroupOut]:
        """The group ``key`` on every live host holding it."""
        out = {}
        for name, client in self.placement.hosts.items():
            if name in self.placement.dead:
                continue
            try:
                r = client.request("GET", f"/v1/groups/{key}")
            except NotFound:
                continue
            out[name] = GroupOut.model_validate(r.json())
        return out

    def _open(self, key: str) -> dict[str, int]:
        """Per live host holding ``key``: its open trajectories of the key (all callers')."""
        return {name: len(grp.trajectories) for name, grp in self._groups(key).items()}

    def _copy_root(self, key: str, source: str, root: str, target: str) -> str:
        """The root ``root`` of ``key`` on host ``source`` loaded on ``target``; its id there."""
        t0 = time.perf_counter()
        folder = self.placement.spool / f"group-{uuid.uuid4().hex[:12]}"
        try:
            self.placement.hosts[source].snapshot(root).save(folder)
            copy = self.placement.hosts[target].load_snapshot(folder, ttl=self.placement.copies.ttl).id
            self.placement.copies.add(target, copy)  # freed by the host if this head dies
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.copies[(key, target)] = copy
        self.placement.counters.migrations += 1
        self.placement.counters.migrate_s += time.perf_counter() - t0
        return copy

    def _join_on(self, host: str, *, key: str, n: int, task: TaskLike | None, image: str | None,
                 tools: list[str] | None, speculation: bool, held: dict[str, str]) -> RemoteGroup:
        """``n`` trajectories of ``key`` on ``host``; ``held``: the key's root on each holder."""
        client = self.placement.hosts[host]

        def join(snapshot: str | None = None) -> RemoteGroup:
            return client.group(key=key, n=n, task=task, image=None if snapshot else image, snapshot=snapshot,
                                tools=tools, speculation=speculation)

        if host in held:  # joined as it was made: from the task, or from a copy with the task
            try:
                return join()
            except StateConflict:
                return join(held[host])
        if task is not None and held:
            source = min(held)
            copy = self._copy_root(key, source, held[source], host)
            try:
                return join(copy)
            except BaseException:
                self._drop_copy(key, host)
                raise
        return join()

    def _drop_copy(self, key: str, host: str) -> None:
        copy = self.copies.pop((key, host), None)
        if copy is not None:
            self.placement.copies.drop(host, copy)
            try:
                self.placement.hosts[host].snapshot(copy).remove()
            except NotFound:
                pass

    def _loads(self, key: str, image_holders: set[str]) -> list[HostLoad]:
        """A host's load: its live workspaces, or the key's open trajectories there if more
        (a group's trajectories have no workspace while they hit its prefix cache); whether
        it holds the group's image (``image_holders``)."""
        open_ = self._open(key)
        loads = []
        for name, lim in self.placement.limits.items():
            dead = name in self.placement.dead
            live = 0 if dead else sum(1 for w in self.placement.hosts[name].list() if w.state != "dead")
            loads.append(HostLoad(name, alive=not dead, holds_root=name in open_,
                                  running=max(live, open_.get(name, 0)), max_workspaces=lim.max_workspaces,
                                  holds_image=name in image_holders))
        return loads

    def join(self, *, key: str, n: int, task: TaskLike | None = None, image: str | None = None,
             tools: list[str] | None = None, speculation: bool = True) -> list[Share]:
        """``n`` new trajectories of ``key`` over the hosts (built from ``task`` or
        ``image`` on the first host; a task's root copied to the next ones)."""
        wanted = _image_of(task, image)
        image_holders = self.placement.images.holders(wanted)
        loads = {h.name: h for h in self._loads(key, image_holders)}
        counts: dict[str, int] = {}
        for _ in range(n):
            c = choose(list(loads.values()))
            h = loads[c.host]
            loads[c.host] = replace(h, holds_root=True, running=h.running + 1)
            counts[c.host] = counts.get(c.host, 0) + 1
        self.placement.counters.placements += n
        shares = []
        held = {h: grp.root for h, grp in self._groups(key).items()}
        try:
            # holders of the key first, then of the image (the root is built where no image moves)
            for host, k in sorted(counts.items(), key=lambda hk: (hk[0] not in held, hk[0] not in image_holders,
                                                                 hk[0])):
                move = self.placement.images.ensure(wanted, host)
                group = self._join_on(host, key=key, n=k, task=task, image=image, tools=tools,
                                      speculation=speculation, held=held)
                held.setdefault(host, group.root)
                shares.append(Share(host, group, move))
        except BaseException:
            for s in shares:
                s.group.close()
            raise
        return shares

    def remove(self, key: str) -> list[str]:
        """Free the group ``key`` on every host holding it; those hosts."""
        held = sorted(self.holders(key))
        for name in held:
            self.placement.hosts[name].request("DELETE", f"/v1/groups/{key}", default_wait=False)
        for k, host in [c for c in self.copies if c[0] == key]:
            if host not in self.placement.dead:
                self._drop_copy(k, host)
        return held


def _image_of(task: TaskLike | None, image: str | None) -> str | None:
    """The image a group's root stands on: the task's, else the one given."""
    if task is None:
        return image
    named = task.get("image") if isinstance(task, Mapping) else task.image
    return named if isinstance(named, str) else "host"


def trajectories(shares: list[Share]) -> list[tuple[str, RemoteTrajectory]]:
    """Every trajectory of ``shares`` with its host, in order."""
    return [(s.host, t) for s in shares for t in s.group.trajectories]
