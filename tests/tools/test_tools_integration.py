"""The built-in and user tools inside a real workspace."""

from __future__ import annotations

import dataclasses

import pytest

from bunshin.tools import ToolSet, command_tool, function_tool
from bunshin.workspace import Workspace

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(no_leaks):
    w = Workspace.create("host", memory="1G", config=no_leaks)
    w.exec("mkdir -p /work/t", timeout=30)
    yield w
    w.remove()


def test_python_is_persistent_and_prints_the_last_expression(ws):
    ts = ToolSet.default(workdir="/work/t")
    assert ts.run_sync(ws, "python", {"code": "import os\nx = 40\nos.getcwd()"}).output == "'/work/t'\n"
    assert ts.run_sync(ws, "python", {"code": "x + 2"}).output == "42\n"
    out = ts.run_sync(ws, "python", {"code": "print('a'); import subprocess; subprocess.run('echo sub', shell=True); None"})
    assert out.output == "a\nsub\n" and out.exit_code == 0
    err = ts.run_sync(ws, "python", {"code": "1/0"})
    assert err.exit_code == 1 and "ZeroDivisionError" in err.output and "pyrepl" not in err.output


@pytest.mark.criu
def test_python_and_bash_state_survive_a_fork(ws):
    ts = ToolSet.default(workdir="/work/t")
    ts.run_sync(ws, "python", {"code": "data = {'k': [1, 2, 3]}"})
    ts.run_sync(ws, "bash", {"command": "export V=forked; cd /tmp"})
    (clone,) = ws.fork(1)
    try:
        assert ts.run_sync(clone, "python", {"code": "data['k'][-1]"}).output == "3\n"
        assert ts.run_sync(clone, "bash", {"command": "echo $V $PWD"}).output == "forked /tmp\n"
    finally:
        clone.remove()


def test_timeouts_interrupt_the_call_not_the_state(ws):
    ts = ToolSet.default(workdir="/work/t")
    for name in ("bash", "python"):
        t = ts.get(name)
        ts.add(dataclasses.replace(t, spec=dataclasses.replace(t.spec, timeout=1.0)), replace=True)
    ts.run_sync(ws, "python", {"code": "kept = 'yes'"})
    slow = ts.run_sync(ws, "python", {"code": "import time\ntime.sleep(30)"})
    assert slow.timed_out and slow.exit_code is None and slow.duration_s < 10
    assert ts.run_sync(ws, "python", {"code": "kept"}).output == "'yes'\n"
    ts.run_sync(ws, "bash", {"command": "export KEPT=1"})
    hung = ts.run_sync(ws, "bash", {"command": "sleep 30"})
    assert hung.timed_out and hung.exit_code is None
    assert ts.run_sync(ws, "bash", {"command": "echo $KEPT"}).output == "1\n"


def _word_count(path: str, min_len: int = 1) -> dict:
    """Count words in a file."""
    import collections

    words = open(path).read().split()
    return dict(collections.Counter(w for w in words if len(w) >= min_len))


def test_user_tools_run_inside(ws):
    ts = ToolSet(workdir="/work/t")
    ts.add(command_tool("grep", "grep -c {pattern} {path}", read_only=True))
    ts.add(function_tool(_word_count, read_only=True))
    ws.files.write("/work/t/f.txt", "a bb a ccc\n")
    assert ts.run_sync(ws, "grep", {"pattern": "bb a", "path": "f.txt"}).output == "1\n"  # one quoted word
    assert ts.run_sync(ws, "grep", {"pattern": "bb", "path": "f.txt"}).output == "1\n"
    out = ts.run_sync(ws, "_word_count", {"path": "f.txt", "min_len": 2})
    assert out.output == '{"bb": 1, "ccc": 1}' and out.exit_code == 0
    missing = ts.run_sync(ws, "_word_count", {"path": "nope"})
    assert missing.exit_code == 1 and "FileNotFoundError" in missing.output
    assert "missing required 'path'" in ts.run_sync(ws, "_word_count", {}).error


def test_invalid_arguments_on_a_real_workspace(ws):
    ts = ToolSet.default(workdir="/work/t")
    for name, args in [("edit", {"path": "x"}), ("python", {}), ("bash", {"command": ""}), ("read_file", "{")]:
        obs = ts.run_sync(ws, name, args)
        assert obs.error and obs.exit_code is None
    assert "is a directory" in ts.run_sync(ws, "read_file", {"path": "/work"}).error
