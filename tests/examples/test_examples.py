"""Each example in examples/ (the quickstart and the trainer-side policy) run as written, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(cfg, name: str) -> str:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu), "BUNSHIN_TMPFS": str(cfg.tmpfs)}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=EXAMPLES.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.criu
def test_quickstart(no_leaks):
    out = run_example(no_leaks, "quickstart.py").splitlines()
    assert re.fullmatch(r"4 forks; the parent paused \d+ ms", out[0]), out
    forks = [line.split() for line in out[1:5]]
    assert [f[1:] for f in forks] == [["fork", str(i)] for i in range(4)] and len({f[0] for f in forks}) == 4
    assert out[5:] == ["parent: started"]


@pytest.mark.criu
def test_trainer_policy(no_leaks):
    out = run_example(no_leaks, "trainer_policy.py").splitlines()
    assert [line.split(":")[0] for line in out] == ["iteration 0", "iteration 1", "iteration 2"], out
    p = [float(re.search(r"p\(correct\) ([0-9.]+)", line).group(1)) for line in out]
    assert p[0] < p[-1], out  # the toy model learned from the group's rewards
