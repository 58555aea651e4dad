"""bunshin on Ray: one host (a ``bunshin serve``) per Ray node, groups placed next to
their task's root snapshot, trajectories retried on another host when theirs dies.

::

    cluster = Cluster.up()                     # a host actor per node of the running Ray cluster
                                               # (the cluster secret on every host: `bunshin cluster init`)
    [h.name for h in cluster.status()]
    with ClusterPlacement.of(cluster) as hosts:
        async with RolloutEngine("bunshin", cluster=hosts) as engine:
            group = await engine.run_group(task, policy, n=64)   # rows: t.placement

Ray is imported only here, when first needed (``pip install 'bunshin[cluster]'``).
"""

from .groups import ClusterGroups, Share
from .placement import ClusterEnv, ClusterPlacement
from .ray_cluster import Cluster
from .records import Endpoint, HostInfo, HostLimits
from .scheduler import HostLoad, Plan, choose, plan
from .secret import ClusterSecret

__all__ = ["Cluster", "ClusterEnv", "ClusterGroups", "ClusterPlacement", "ClusterSecret", "Endpoint", "HostInfo",
           "HostLimits", "HostLoad", "Plan", "Share", "choose", "plan"]
