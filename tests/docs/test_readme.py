"""The README as a newcomer reads it: short, its links there, its numbers generated, and its
Python code blocks run as written (on the real runtime, in a private home)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin.bench import results

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)


def test_readme_is_short():
    assert len(README.splitlines()) <= 200


def test_numbers_table_is_what_the_records_make():
    want = results.readme_table(results.load_all(ROOT / "docs" / "results"))
    assert want in README, "run `python -m bunshin.bench.results readme` (hand edits are overwritten)"


def test_relative_links_resolve():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links its docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_python_blocks_are_the_quickstart_and_the_trainer():
    assert len(BLOCKS) == 2
    assert "ws.fork(" in BLOCKS[0] and len(BLOCKS[0].strip().splitlines()) <= 10
    assert "CallablePolicy" in BLOCKS[1] and "RolloutEngine" in BLOCKS[1]


@pytest.mark.integration
@pytest.mark.criu
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=["quickstart", "trainer"][: len(BLOCKS)])
def test_python_block_runs_as_written(index, cfg, no_leaks, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(BLOCKS[index])
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu),
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    # the output the block's last comment promises
    promised = re.findall(r"print\(.*\)\s+# (\[.*\])", BLOCKS[index])
    assert promised and out.stdout.strip().splitlines()[-1] == promised[-1]
