"""Imports point only down the layer stack, with no cycles; the agent imports only the stdlib.

The rules are import-linter contracts in pyproject.toml (``[tool.importlinter]``):
layers (runtime -> workspace -> tools/speculate -> cache -> rollout -> bench -> cli),
the agent package free of anything but the standard library, the cache free of the
rollout engine, the runtime's rooms (upkeep -> snapshot -> criu -> container -> ... ->
kernel/state), and no import cycle between sibling modules, TYPE_CHECKING imports
included. ``make lint`` runs them too.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "bunshin"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.skip("import-linter is not installed: pip install -e '.[dev]'")
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"})


def test_import_contracts_hold():
    r = _lint_imports(REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("runtime/kernel/limits.py", "from ...cache import policy", "Layers only import downward"),
    ("runtime/kernel/limits.py", "from ..criu import run", "The runtime's rooms import only downward"),
    ("agent/wire.py", "import psutil", "The in-workspace agent imports only the standard library"),
    ("cache/policy.py", "from ..rollout import records", "The cache does not depend on the rollout engine"),
    ("tools/spec.py", "from . import toolset", "No import cycles"),
])
def test_a_planted_violation_breaks_its_contract(tmp_path, module, line, contract):
    """The contracts can fail: the same tree with one bad import is refused."""
    shutil.copytree(PKG, tmp_path / "bunshin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    target = tmp_path / "bunshin" / module
    target.write_text(target.read_text() + f"\n{line}  # planted by the test\n")
    r = _lint_imports(tmp_path)
    assert r.returncode != 0
    broken = r.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, r.stdout[-4000:]


def test_agent_uses_only_the_standard_library():
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for path in (PKG / "agent").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] not in stdlib | {"__future__"}]
    assert not bad, bad
