"""bunshin: live-forkable, isolated workspaces for RL of tool-using agents.

The public API, importable from here::

    from bunshin import Workspace, AsyncWorkspace, ToolSet, PrefixCache

    with Workspace.create("host", memory="1G") as ws:
        ws.exec("echo hi > /tmp/x")
        clones = ws.fork(4)                  # 4 live copy-on-write clones
        print(clones.timings.pause_ms)       # what the fork cost the parent
        remove_all(clones)

Also here: the rollout engine and the hook for your own model (``RolloutEngine``,
``CallablePolicy``, ``TaskSpec``), the client of a ``bunshin serve`` host
(``Client``, ``AsyncClient``) and batch removal (``remove_all``).

Names are loaded on first use (``import bunshin`` stays cheap; ``bunshin.errors``
and ``bunshin.config`` do not pull in the runtime). What is exported is pinned by
``tests/test_exports.py``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .cache import CachePolicy, CacheStats, PrefixCache, Trajectory
    from .client import AsyncClient, Client
    from .config import Config
    from .errors import (
        AgentError,
        BunshinError,
        CriuError,
        HostUnsupported,
        IdempotencyKeyReused,
        ImageNotFound,
        InvalidArgument,
        NotForkable,
        NotFound,
        PathNotFound,
        PolicyError,
        RateLimited,
        RequestInProgress,
        ResourceExhausted,
        RuntimeFailure,
        SetupFailed,
        SnapshotNotFound,
        StateConflict,
        ToolError,
        ToolTimeout,
        Unauthorized,
        Unreachable,
        WorkspaceNotFound,
    )
    from .rollout import (
        CallablePolicy,
        GroupResult,
        PolicyContext,
        RolloutEngine,
        TaskSpec,
        TrajectoryResult,
        load_task,
    )
    from .runtime.agent_host.types import (
        ExecResult,
        FileEntry,
        FileType,
        ProcessInfo,
        SessionInfo,
        SessionResult,
    )
    from .runtime.container.stats import MemoryStats, WorkspaceStats
    from .runtime.state.records import Mount, SnapshotMode, WorkspaceState
    from .speculate import SpeculationPolicy, SpeculationStats
    from .tools import Observation, Tool, ToolSet, ToolSpec, command_tool, function_tool
    from .workspace import LocalHost, Session, Snapshot, Workspace, WorkspaceInfo
    from .workspace.aio import AsyncSnapshot, AsyncWorkspace, ThreadBridge
    from .workspace.batch import remove_all
    from .workspace.forks import ForkResult, ForkTimings
    from .workspace.protocol import (
        CommandsAPI,
        FilesAPI,
        HostAPI,
        SessionsAPI,
        SnapshotAPI,
        WorkspaceAPI,
    )

_WHERE = {
    # workspaces and snapshots: the local implementation, the async adapter, the protocols
    "Workspace": "workspace", "Snapshot": "workspace", "Session": "workspace",
    "WorkspaceInfo": "workspace", "LocalHost": "workspace",
    "AsyncWorkspace": "workspace.aio", "AsyncSnapshot": "workspace.aio",
    "ThreadBridge": "workspace.aio", "remove_all": "workspace.batch",
    "ForkResult": "workspace.forks", "ForkTimings": "workspace.forks",
    # rollouts: the engine and your own policy; the client of a `bunshin serve` host
    **{name: "rollout" for name in (
        "RolloutEngine", "CallablePolicy", "PolicyContext", "TaskSpec", "load_task", "GroupResult",
        "TrajectoryResult")},
    "Client": "client", "AsyncClient": "client",
    "WorkspaceAPI": "workspace.protocol", "SnapshotAPI": "workspace.protocol",
    "CommandsAPI": "workspace.protocol", "FilesAPI": "workspace.protocol",
    "SessionsAPI": "workspace.protocol", "HostAPI": "workspace.protocol",
    # records
    "ExecResult": "runtime.agent_host.types", "SessionResult": "runtime.agent_host.types",
    "SessionInfo": "runtime.agent_host.types", "FileEntry": "runtime.agent_host.types",
    "FileType": "runtime.agent_host.types", "ProcessInfo": "runtime.agent_host.types",
    "WorkspaceStats": "runtime.container.stats", "MemoryStats": "runtime.container.stats",
    "Mount": "runtime.state.records", "SnapshotMode": "runtime.state.records",
    "WorkspaceState": "runtime.state.records",
    "Config": "config",
    # tools, the prefix cache, speculation
    "ToolSet": "tools", "Tool": "tools", "ToolSpec": "tools", "Observation": "tools",
    "command_tool": "tools", "function_tool": "tools",
    "PrefixCache": "cache", "CachePolicy": "cache", "CacheStats": "cache", "Trajectory": "cache",
    "SpeculationPolicy": "speculate", "SpeculationStats": "speculate",
    # the error tree (see bunshin.errors)
    **{name: "errors" for name in (
        "BunshinError", "InvalidArgument", "NotFound", "WorkspaceNotFound", "SnapshotNotFound",
        "ImageNotFound", "PathNotFound", "StateConflict", "NotForkable", "ToolTimeout",
        "ResourceExhausted", "AgentError", "PolicyError", "HostUnsupported", "RuntimeFailure", "ToolError",
        "CriuError", "SetupFailed", "Unauthorized", "Unreachable", "RateLimited", "RequestInProgress",
        "IdempotencyKeyReused")},
}

__all__ = [  # every key of _WHERE (tests/test_exports.py pins both)
    "AsyncClient", "CallablePolicy", "Client", "ForkResult", "ForkTimings", "GroupResult", "PolicyContext",
    "RolloutEngine", "TaskSpec", "TrajectoryResult", "load_task", "remove_all",
    "AgentError", "AsyncSnapshot", "AsyncWorkspace", "BunshinError", "CachePolicy", "CacheStats",
    "CommandsAPI", "Config", "CriuError", "ExecResult", "FileEntry", "FileType", "FilesAPI",
    "HostAPI", "HostUnsupported", "IdempotencyKeyReused", "ImageNotFound", "InvalidArgument", "LocalHost", "MemoryStats", "Mount", "NotForkable",
    "NotFound", "Observation", "PathNotFound", "PolicyError", "PrefixCache", "ProcessInfo",
    "RateLimited", "RequestInProgress", "ResourceExhausted", "RuntimeFailure", "Session", "SessionInfo", "SessionResult",
    "SessionsAPI", "SetupFailed", "Snapshot", "SnapshotAPI", "SnapshotMode", "SnapshotNotFound",
    "SpeculationPolicy", "SpeculationStats", "StateConflict", "ThreadBridge", "Tool", "ToolError",
    "ToolSet", "ToolSpec", "ToolTimeout", "Trajectory", "Unauthorized", "Unreachable", "Workspace", "WorkspaceAPI",
    "WorkspaceInfo", "WorkspaceNotFound", "WorkspaceState", "WorkspaceStats", "command_tool",
    "function_tool",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'bunshin' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
