"""Tests that need root or CRIU skip with a reason where the machine cannot run them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEEDS_CRIU = "tests/workspace/test_fork.py::test_clone_heap_equals_parent_then_diverges"
NEEDS_ROOT = "tests/runtime/test_container.py"
PURE = "tests/speculate/test_predictor.py"


def _pytest(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> str:
    cmd = [*prefix, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args]
    run_env = {**os.environ, "BUNSHIN_TEST_SHARED_MACHINE": "1", **(env or {})}
    r = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux's unshare")
def test_without_root_integration_tests_skip_and_say_why():
    # A user namespace where this process is uid 1000: no longer root, same files readable.
    out = _pytest(NEEDS_CRIU, NEEDS_ROOT, PURE,
                  prefix=("unshare", "--user", "--map-user=1000", "--map-group=1000"))
    assert "needs root (user and mount namespaces" in out
    assert " passed" in out and " skipped" in out
    assert "failed" not in out and "error" not in out.lower()


def test_without_criu_criu_tests_skip_and_say_how_to_get_it(tmp_path):
    out = _pytest(NEEDS_CRIU, PURE, env={"BUNSHIN_CRIU": str(tmp_path / "no-criu")})
    assert f"needs CRIU >= 4.2 at {tmp_path / 'no-criu'}" in out
    assert "1 skipped" in out and " passed" in out
