"""The public API: what ``from bunshin import ...`` offers is pinned here."""

from __future__ import annotations

import subprocess
import sys

import pytest

import bunshin

PUBLIC = [
    "AsyncClient", "CallablePolicy", "Client", "ForkResult", "ForkTimings", "GroupResult", "PolicyContext",
    "RolloutEngine", "TaskSpec", "TrajectoryResult", "load_task", "remove_all",
    "AgentError", "AsyncSnapshot", "AsyncWorkspace", "BunshinError", "CachePolicy", "CacheStats",
    "CommandsAPI", "Config", "CriuError", "ExecResult", "FileEntry", "FileType", "FilesAPI",
    "HostAPI", "HostUnsupported", "IdempotencyKeyReused", "ImageNotFound", "InvalidArgument", "LocalHost", "MemoryStats", "Mount", "NotForkable",
    "NotFound", "Observation", "PathNotFound", "PolicyError", "PrefixCache", "ProcessInfo",
    "RateLimited", "RequestInProgress", "ResourceExhausted", "RuntimeFailure", "Session", "SessionInfo", "SessionResult", "SessionsAPI",
    "SetupFailed", "Snapshot", "SnapshotAPI", "SnapshotMode", "SnapshotNotFound", "SpeculationPolicy",
    "SpeculationStats", "StateConflict", "ThreadBridge", "Tool", "ToolError", "ToolSet", "ToolSpec", "ToolTimeout",
    "Trajectory", "Unauthorized", "Unreachable", "Workspace", "WorkspaceAPI", "WorkspaceInfo", "WorkspaceNotFound", "WorkspaceState",
    "WorkspaceStats", "command_tool", "function_tool",
]


def test_all_is_pinned():
    assert sorted(bunshin.__all__) == sorted(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_every_export_resolves(name):
    obj = getattr(bunshin, name)
    assert getattr(obj, "__name__", name) == name
    assert name in dir(bunshin)


def test_star_import_gives_exactly_all():
    ns: dict[str, object] = {}
    exec("from bunshin import *", ns)
    assert sorted(k for k in ns if k != "__builtins__") == sorted(PUBLIC)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Workspaces'"):
        bunshin.Workspaces  # noqa: B018


def test_errors_and_config_import_without_the_runtime():
    code = ("import sys, bunshin.errors, bunshin.config; "
            "print(sorted(m for m in sys.modules if m.startswith('bunshin.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_export_says_where_it_lives():
    assert sorted(bunshin._WHERE) == sorted(bunshin.__all__)


def test_the_package_says_it_is_typed():
    """PEP 561: ``py.typed`` beside ``__init__`` and in the package data a wheel ships."""
    import tomllib
    from pathlib import Path

    root = Path(bunshin.__file__).parent
    assert (root / "py.typed").is_file()
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["bunshin"]
