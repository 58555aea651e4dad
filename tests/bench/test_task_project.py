"""The cache benchmark's task project ships with bunshin, and its recorded edits fit it."""

from __future__ import annotations

import subprocess
import sys

from bunshin.bench import cache as cache_bench
from bunshin.bench import task_project

APPLY_EACH = """
import pathlib, subprocess, sys, json
edits = json.loads(sys.argv[1])
recipes = pathlib.Path("recipekit/recipes.py")
original = recipes.read_text()
for old, new in [(None, None), *edits]:
    recipes.write_text(original if old is None else original.replace(old, new))
    r = subprocess.run([sys.executable, "-m", "unittest", "-q"], capture_output=True, text=True)
    assert r.returncode == 0 and "Ran 62 tests" in r.stderr, (old, r.stderr[-800:])
print("ok")
"""


def test_every_edit_is_where_the_trajectories_read(tmp_path):
    lines = task_project.FILES[cache_bench.RECIPES].splitlines()
    text = "\n".join(lines)
    for name, (lo, hi, old, _new) in cache_bench.EDITS.items():
        assert text.count(old) == 1, name
        first = old.splitlines()[0]
        at = lines.index(first) + 1
        assert lo <= at <= hi and lines[lo - 1].startswith(f"def {name}("), name
    assert text.count(cache_bench.FOLLOW_UP[0][1]["old_str"]) == 1


def test_its_tests_pass_before_and_after_each_edit(tmp_path):
    import json

    for path, body in task_project.FILES.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    edits = [[old, new] for _lo, _hi, old, new in cache_bench.EDITS.values()]
    r = subprocess.run([sys.executable, "-c", APPLY_EACH, json.dumps(edits)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr[-2000:]
