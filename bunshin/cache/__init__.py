"""The stateful tool prefix cache.

``PrefixCache(tools)`` keeps, per task root snapshot, a tree of tool calls: each
node holds the call's observation and, when worth its memory, a snapshot of the
workspace after it. ``cache.start(root)`` gives a ``Trajectory`` that walks the
tree without a workspace while it hits and materialises one (a fork of the
deepest snapshot on its path, plus a replay of what follows) on its first miss.
``traj.history`` is a list of ``bunshin.tools.Step`` records.

Modules, each importing only those before it: ``policy``, ``tree`` (nodes and
workspace handles, no I/O), ``handles`` (what is done to workspaces), ``persist``,
``engine`` (the state and its public operations), ``speculation``, ``trajectory``,
``prefix`` (the façade).
"""

from .engine import CacheEngine
from .policy import CachePolicy, CacheStats, TrajectoryStats
from .prefix import PrefixCache
from .trajectory import Trajectory

__all__ = ["CacheEngine", "CachePolicy", "CacheStats", "PrefixCache", "Trajectory", "TrajectoryStats"]
