"""Workload `coding-lite`: a coding agent fixing a bug in a small Python project (no download needed).

Setup writes the project (``/work/proj``: package ``textkit``, unittest tests, one of
them slow), creates its virtualenv (without pip: nothing is installed) and byte-compiles it. Trajectories explore with
``bash`` and ``read_file``, run the tests, fix the bug with ``edit`` (two right
fixes, one wrong), run the tests again. The reward is the fraction of hidden tests
that pass.
"""

from __future__ import annotations

import random

from ...rollout.policies import Trace
from ...rollout.task import TaskSpec, parse_task
from ...tools import Step, ToolCall
from .common import think

SLUG = '''"""Slugs for titles."""


def slugify(text):
    out = []
    for ch in text.lower():
        if ch.isalnum():
            out.append(ch)
        elif out and out[-1] != "-":
            out.append("-")
    return "".join(out)
'''

WRAP = '''"""Greedy line wrapping."""


def wrap(text, width):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) >= width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
'''

FREQ = '''"""Word frequencies."""

import collections


def word_freq(text):
    return collections.Counter(w.strip(".,;:!?") for w in text.split(" ") if w.strip(".,;:!?"))
'''

TESTS = '''import unittest

from textkit.freq import word_freq
from textkit.slug import slugify
from textkit.wrap import wrap


class Basic(unittest.TestCase):
    def test_slug(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_wrap(self):
        self.assertEqual(wrap("a b c", 10), ["a b c"])

    def test_freq(self):
        self.assertEqual(word_freq("a b a")["a"], 2)

    def test_big_corpus(self):  # slow on purpose: the suite takes about a second
        words = " ".join("w%d" % (i % 5000) for i in range(400_000))
        self.assertEqual(len(word_freq(words)), 5000)
        self.assertTrue(all(len(x) <= 60 for x in wrap(words, 60)))


if __name__ == "__main__":
    unittest.main()
'''

GRADE = '''import sys
sys.path.insert(0, "/work/proj")
from textkit.freq import word_freq
from textkit.slug import slugify
from textkit.wrap import wrap
checks = [
    lambda: slugify("Hello, World!") == "hello-world",
    lambda: slugify("  Trailing  ") == "trailing",
    lambda: slugify("a--b") == "a-b",
    lambda: wrap("aaa bbb ccc", 7) == ["aaa bbb", "ccc"],
    lambda: wrap("one two", 7) == ["one two"],
    lambda: wrap("", 5) == [],
    lambda: word_freq("a  b\\ta\\nb a")["a"] == 3,
    lambda: word_freq("Go, go!")["go"] == 1,
]
ok = 0
for c in checks:
    try:
        ok += bool(c())
    except Exception:
        pass
print(ok / len(checks))
'''

#: per bug: the file, the tests command output focus, right fixes and a wrong one (old, new)
BUGS = {
    "slug": ("textkit/slug.py", [('return "".join(out)', 'return "".join(out).strip("-")'),
                                 ('return "".join(out)', 'return "".join(out).rstrip("-")')],
             ('return "".join(out)', 'return "".join(out).replace("-", "")')),
    "wrap": ("textkit/wrap.py", [(">= width", "> width"), ("1 + len(word) >= width", "len(word) >= width")],
             (">= width", ">= width - 1")),
    "freq": ("textkit/freq.py", [('text.split(" ")', "text.split()"),
                                 ('text.split(" ")', "text.replace(chr(9), ' ').replace(chr(10), ' ').split()")],
             ('text.split(" ")', 'text.lower().split(" ")')),
}
TEST_CMD = "cd /work/proj && /work/.venv/bin/python -m unittest -q 2>&1 | tail -4 | sed -E 's/ in [0-9.]+s//'"


def task(i: int, *, seed: int) -> TaskSpec:
    bug = list(BUGS)[i % len(BUGS)]
    files = {"/work/proj/textkit/__init__.py": "", "/work/proj/textkit/slug.py": SLUG,
             "/work/proj/textkit/wrap.py": WRAP, "/work/proj/textkit/freq.py": FREQ,
             "/work/proj/tests/__init__.py": "", "/work/proj/tests/test_basic.py": TESTS,
             "/work/proj/README.md": f"# textkit\n\nSmall text utilities. Issue #{100 + i}: {bug} is wrong "
                                     "on edge cases.\n", "/opt/grader/grade.py": GRADE}
    return parse_task({
        "id": f"lite-{i}",
        "memory": "1G",
        "files": files,
        "setup": [
            "python3 -m venv --without-pip /work/.venv",  # the task never installs: no pip to seed
            "echo /work/proj > /work/.venv/lib/$(ls /work/.venv/lib)/site-packages/textkit.pth",
            "/work/.venv/bin/python -m compileall -q /work/proj >/dev/null",
        ],
        "tools": ["bash", "read_file", "edit", "write_file"],
        "workdir": "/work/proj",
        "prompt": f"Fix issue #{100 + i} in /work/proj ({bug} mishandles edge cases). Run the tests.",
        "max_turns": 12,
        "reward": "/work/.venv/bin/python /opt/grader/grade.py",
        "call_timeout": 120,
        "trajectory_timeout": 900,
        "metadata": {"workload": "coding-lite", "bug": bug},
    })


def traces(t: TaskSpec, n: int, *, seed: int, think_scale: float) -> list[Trace]:
    """``n`` attempts: look around, run the tests, read the file, fix (right or wrong), re-test."""
    bug = t.metadata["bug"]
    path, fixes, wrong = BUGS[bug]
    out = []
    for j in range(n):
        rng = random.Random(f"{seed}:{t.id}:{j}")
        calls: list[tuple[str, dict]] = [("bash", {"command": "ls -R /work/proj | head -30 && cat README.md"})]
        if rng.random() < 0.7:
            calls.append(("bash", {"command": TEST_CMD}))
        if rng.random() < 0.3:
            calls.append(("bash", {"command": "grep -rn 'def ' textkit | head -20"}))
        calls.append(("read_file", {"path": path}))
        old, new = rng.choices([*fixes, wrong], weights=[3, 2, 2])[0]
        calls.append(("edit", {"path": path, "old_str": old, "new_str": new}))
        calls.append(("bash", {"command": TEST_CMD}))
        if rng.random() < 0.3:
            calls.append(("bash", {"command": "git status 2>/dev/null || ls textkit"}))
        steps = tuple(Step(i + 1, think(rng, think_scale), ToolCall(name, args))
                      for i, (name, args) in enumerate(calls))
        out.append(Trace(f"{t.id}-trace-{j}", steps, task=t.id, final_content="fixed",
                         final_think_s=think(rng, think_scale) / 2))
    return out
