"""The python tool's in-workspace interpreter (bunshin/agent/pyrepl.py), run on the host."""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import bunshin

AGENT_DIR = Path(bunshin.__file__).parent / "agent"
REPL = AGENT_DIR / "pyrepl.py"
# loaded alone, as the workspace runs it: it imports nothing from its package
_spec = importlib.util.spec_from_file_location("pyrepl", REPL)
assert _spec and _spec.loader
pyrepl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pyrepl)


@pytest.fixture
def repl(tmp_path):
    """``call(code, timeout=10)`` against an interpreter in ``tmp_path``; killed afterwards."""
    run_dir, workdir = tmp_path / "run", tmp_path / "work"
    workdir.mkdir()

    def call(code: str, timeout: float = 10.0, **extra) -> dict:
        r = subprocess.run([sys.executable, str(REPL), "call", str(run_dir), str(workdir)],
                           input=json.dumps({"code": code, "timeout": timeout, **extra}),
                           capture_output=True, text=True, timeout=timeout + 15, check=True)
        return json.loads(r.stdout)

    call.workdir = workdir
    call.run_dir = run_dir
    yield call
    if (run_dir / pyrepl.SOCKET_NAME).exists():
        os.kill(int(call("import os\nos.getpid()")["output"]), signal.SIGKILL)


def test_state_persists_and_the_last_expression_is_printed(repl):
    assert repl("import os\nx = 40\nos.getcwd()") == {
        "output": f"{str(repl.workdir)!r}\n", "exit_code": 0, "timed_out": False}
    assert repl("x + 2")["output"] == "42\n"
    out = repl("print('a'); import subprocess; subprocess.run('echo sub', shell=True); None")
    assert out["output"] == "a\nsub\n" and out["exit_code"] == 0
    assert repl("import sys\nsys.exit(3)")["exit_code"] == 3


def test_errors_show_the_users_code_only(repl):
    err = repl("1/0")
    assert err["exit_code"] == 1 and "ZeroDivisionError" in err["output"] and "pyrepl" not in err["output"]
    bad = repl("def f(:")
    assert bad["exit_code"] == 1 and "SyntaxError" in bad["output"] and "pyrepl" not in bad["output"]


def test_a_timeout_interrupts_the_call_not_the_state(repl):
    repl("kept = 'yes'")
    slow = repl("import time\ntime.sleep(30)", timeout=0.5)
    assert slow["timed_out"] and slow["exit_code"] is None and "KeyboardInterrupt" in slow["output"]
    assert repl("kept")["output"] == "'yes'\n"


def test_an_interpreter_ignoring_the_interrupt_is_restarted(repl):
    repl("kept = 1")
    hung = repl("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(30)",
                timeout=0.5)
    assert hung == {"output": "(the interpreter did not stop; it was restarted)\n",
                    "exit_code": None, "timed_out": True}
    assert "NameError" in repl("kept")["output"]  # a fresh interpreter


def test_a_split_run_keeps_streams_value_and_error_apart(repl):
    """The E2B interpreter's requests: stdout and stderr apart, the trailing value's displays
    and the exception as data, ``env`` for the run only, the run count."""
    first = repl("import os, sys\nclass H:\n    def _repr_html_(self): return '<b>h</b>'\n"
                 "print('out'); print('err', file=sys.stderr)\nH()", split=True, exec_id="e1", env={"E2BX": "1"})
    assert first["stdout"] == "out\n" and first["stderr"] == "err\n" and first["error"] is None
    assert first["result"]["text/html"] == "<b>h</b>" and first["result"]["text/plain"].startswith("<__main__.H")
    assert first["exit_code"] == 0 and not first["timed_out"]
    second = repl("os.environ.get('E2BX', 'unset')", split=True, env={})
    assert second["result"] == {"text/plain": "'unset'"} and second["count"] == first["count"] + 1
    failed = repl("def f():\n    raise ValueError('bad v')\nf()", split=True)
    assert failed["error"]["name"] == "ValueError" and failed["error"]["value"] == "bad v"
    assert 'line 2, in f' in failed["error"]["traceback"] and "pyrepl" not in failed["error"]["traceback"]
    assert failed["stderr"] == "" and failed["result"] is None and failed["exit_code"] == 1
    assert repl("def g(:", split=True)["error"]["name"] == "SyntaxError"
    assert repl("raise SystemExit(0)", split=True)["error"] is None
    assert int((repl.run_dir / pyrepl.PID_NAME).read_text()) > 0
    assert sorted(p.name for p in repl.run_dir.iterdir()) == ["py.pid", "py.sock"]  # no run's files left


def test_a_split_run_is_interrupted_at_its_timeout(repl):
    slow = repl("import time\ntime.sleep(30)", timeout=0.5, split=True)
    assert slow["timed_out"] and slow["error"]["name"] == "KeyboardInterrupt"


def test_no_agent_module_shadows_the_standard_library():
    # pyrepl.py runs by path: its folder is first on sys.path while it imports the stdlib
    names = {m.name for m in pkgutil.iter_modules([str(AGENT_DIR)])}
    assert "pyrepl" in names and not names & sys.stdlib_module_names


def test_importing_it_starts_nothing():
    # the agent layer's build imports every module of the package
    r = subprocess.run([sys.executable, "-c", "import pyrepl"], cwd=AGENT_DIR, capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 0 and not r.stdout and not r.stderr
