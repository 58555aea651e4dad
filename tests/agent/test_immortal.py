"""The agent's objects made immortal when it is ready (Python 3.12+), nothing done below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin.agent import immortal
from bunshin.runtime.agent_host.bundle import agent_python

AGENT_DIR = Path(immortal.__file__).parent

_SCRIPT = r"""
import gc, json, sys
sys.path.insert(0, sys.argv[1])
import immortal
held = {"items": [object() for _ in range(3)]}
item = held["items"][0]
before = sys.getrefcount(item)
made = immortal.make_all_immortal()
after = sys.getrefcount(item)
refs = [item] * 1000
with_refs = sys.getrefcount(item)
del refs
fresh = object()
print(json.dumps({"made": made, "before": before, "after": after, "with_refs": with_refs,
                  "fresh": sys.getrefcount(fresh), "limit": immortal.IMMORTAL_REFCNT}))
"""


def test_objects_held_when_ready_become_immortal_later_ones_do_not():
    python = agent_python()
    if tuple(map(int, python.version.split("."))) < (3, 12):
        pytest.skip(f"the agent's Python is {python.version}: no immortal objects before 3.12")
    out = subprocess.run([str(python.binary), "-S", "-c", _SCRIPT, str(AGENT_DIR)],
                         capture_output=True, text=True, check=True, timeout=60)
    r = json.loads(out.stdout)
    assert r["made"] > 1000  # modules, functions, code, strings: everything reachable
    assert r["before"] < 10
    assert r["after"] == r["with_refs"] >= r["limit"]  # a thousand more references wrote nothing
    assert r["fresh"] < 10  # made after: counted as usual


def test_nothing_is_done_below_312():
    if sys.version_info >= (3, 12):
        pytest.skip("this Python has immortal objects")
    item = object()
    before = sys.getrefcount(item)
    assert immortal.make_all_immortal() == 0
    refs = [item] * 10
    assert sys.getrefcount(item) == before + 10  # counts untouched: still counted
    del refs
