"""Imports point only down the layer stack (DESIGN.md); the agent imports only the stdlib."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "bunshin"
RANK = {
    "errors": 0, "config": 0, "console": 0,
    "runtime": 1,
    "workspace": 2,
    "tools": 3, "cache": 3, "speculate": 3,
    "rollout": 4,
    "bench": 5,
    "server": 6, "client": 6, "cluster": 6, "cli": 7,
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")[: -node.level] if path.name != "__init__.py" else mod.split(".")[: len(mod.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                out.append(name)
                out += [f"{name}.{a.name}" for a in node.names] if not node.module else []
            else:
                out.append(node.module or "")
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "bunshin" else None


def test_imports_only_go_down():
    bad = []
    for path in PKG.rglob("*.py"):
        own = path.relative_to(PKG).parts[0].removesuffix(".py")
        if own == "agent" or own not in RANK:
            continue
        for imp in _imports(path):
            layer = _layer(imp)
            if layer and layer in RANK and RANK[layer] > RANK[own]:
                bad.append(f"{path.relative_to(PKG.parent)} imports {imp}")
    assert not bad, "\n".join(bad)


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
