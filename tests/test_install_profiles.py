"""The core install (`pip install bunshin`: library, CLI, server) needs no torch, TRL, Ray or
frameworks: neither in its dependencies nor when its entry points are imported."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "trl", "transformers", "ray", "gymnasium", "skyrl_gym", "minisweagent", "swerex",
         "openenv", "harbor", "verl", "e2b", "mkdocs")


def test_core_entry_points_import_nothing_heavy():
    code = ("import sys, bunshin, bunshin.cli.main, bunshin.server, bunshin.server.app, bunshin.client\n"
            "bunshin.cli.main.build_parser()\n"
            "from bunshin import Workspace, AsyncWorkspace, ToolSet, PrefixCache\n"
            "import bunshin.rollout\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_core_dependencies_name_no_heavy_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    for name in ("torch", "trl", "ray", "transformers", "gymnasium", "mkdocs", "e2b"):
        assert name not in core.replace("-", "_").split(), name
    extras = project["optional-dependencies"]
    assert {"test", "docs", "adapters", "cluster", "desktop", "e2b", "all"} <= set(extras)
    assert any("torch" in d for d in extras["adapters"]) and any("ray" in d for d in extras["cluster"])
