"""bunshin on Ray: one host (a ``bunshin serve``) per Ray node, groups placed next to
their task's root snapshot, trajectories retried on another host when theirs dies.

::

    cluster = Cluster.up()                     # a host actor per node of the running Ray cluster
    [h.name for h in cluster.status()]
    async with RolloutEngine("bunshin", env_factory=ClusterEnvs(cluster.clients())) as engine:
        group = await engine.run_group(task, policy, n=64)

Ray is imported only here, when first needed (``pip install 'bunshin[cluster]'``).
"""

from .ray_cluster import Cluster
from .records import Endpoint, HostInfo, HostLimits

__all__ = ["Cluster", "Endpoint", "HostInfo", "HostLimits"]
