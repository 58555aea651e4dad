"""The HTTP API's groups over the cluster: a group key's trajectories placed on its hosts.

``ClusterGroups(placement).join(key=..., n=..., task=...)`` places this caller's ``n``
trajectories with the scheduler (hosts whose server already holds the key first, then
room: ``max_workspaces`` minus the key's open trajectories or the live workspaces
there, whichever is more) and joins the key on each
host chosen (``POST /v1/groups``); each host's group has its own root and prefix cache.
Where a key lives is asked of the hosts (``GET /v1/groups/{key}``), so callers in other
processes place theirs next to it too.

Limit: a host that does not hold the key yet builds its root from the task itself (its
setup runs there again): a server group cannot yet start from a copied snapshot *and*
keep the task's reward command and tools (``POST /v1/groups`` takes one of image,
snapshot or task), so the root copy :class:`~bunshin.cluster.ClusterPlacement` does for
the engine is not done here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..api.groups import GroupOut
from ..client.groups import RemoteGroup, RemoteTrajectory, TaskLike
from ..errors import NotFound
from .placement import ClusterPlacement
from .scheduler import HostLoad, choose


@dataclass(frozen=True)
class Share:
    """This caller's trajectories of a key on one host."""

    host: str
    group: RemoteGroup


class ClusterGroups:
    def __init__(self, placement: ClusterPlacement) -> None:
        self.placement = placement

    def holders(self, key: str) -> set[str]:
        """The live hosts whose server holds the group ``key``."""
        return set(self._open(key))

    def _open(self, key: str) -> dict[str, int]:
        """Per live host holding ``key``: its open trajectories of the key (all callers')."""
        out = {}
        for name, client in self.placement.hosts.items():
            if name in self.placement.dead:
                continue
            try:
                r = client.request("GET", f"/v1/groups/{key}")
            except NotFound:
                continue
            out[name] = len(GroupOut.model_validate(r.json()).trajectories)
        return out

    def _loads(self, key: str) -> list[HostLoad]:
        """A host's load: its live workspaces, or the key's open trajectories there if more
        (a group's trajectories have no workspace while they hit its prefix cache)."""
        open_ = self._open(key)
        loads = []
        for name, lim in self.placement.limits.items():
            dead = name in self.placement.dead
            live = 0 if dead else sum(1 for w in self.placement.hosts[name].list() if w.state != "dead")
            loads.append(HostLoad(name, alive=not dead, holds_root=name in open_,
                                  running=max(live, open_.get(name, 0)), max_workspaces=lim.max_workspaces))
        return loads

    def join(self, *, key: str, n: int, task: TaskLike | None = None, image: str | None = None,
             tools: list[str] | None = None, speculation: bool = True) -> list[Share]:
        """``n`` new trajectories of ``key`` over the hosts (built from ``task`` or
        ``image`` on a host that has none of the key yet)."""
        loads = {h.name: h for h in self._loads(key)}
        counts: dict[str, int] = {}
        for _ in range(n):
            c = choose(list(loads.values()))
            h = loads[c.host]
            loads[c.host] = HostLoad(h.name, alive=True, holds_root=True, running=h.running + 1,
                                     max_workspaces=h.max_workspaces)
            counts[c.host] = counts.get(c.host, 0) + 1
        self.placement.counters.placements += n
        shares = []
        try:
            for host, k in counts.items():
                group = self.placement.hosts[host].group(key=key, n=k, task=task, image=image, tools=tools,
                                                         speculation=speculation)
                shares.append(Share(host, group))
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
        return held


def trajectories(shares: list[Share]) -> list[tuple[str, RemoteTrajectory]]:
    """Every trajectory of ``shares`` with its host, in order."""
    return [(s.host, t) for s in shares for t in s.group.trajectories]
