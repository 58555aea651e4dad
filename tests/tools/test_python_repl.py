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

    def call(code: str, timeout: float = 10.0) -> dict:
        r = subprocess.run([sys.executable, str(REPL), "call", str(run_dir), str(workdir)],
                           input=json.dumps({"code": code, "timeout": timeout}),
                           capture_output=True, text=True, timeout=timeout + 15, check=True)
        return json.loads(r.stdout)

    call.workdir = workdir
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


def test_no_agent_module_shadows_the_standard_library():
    # pyrepl.py runs by path: its folder is first on sys.path while it imports the stdlib
    names = {m.name for m in pkgutil.iter_modules([str(AGENT_DIR)])}
    assert "pyrepl" in names and not names & sys.stdlib_module_names


def test_importing_it_starts_nothing():
    # the agent layer's build imports every module of the package
    r = subprocess.run([sys.executable, "-c", "import pyrepl"], cwd=AGENT_DIR, capture_output=True,
                       text=True, timeout=30, check=False)
    assert r.returncode == 0 and not r.stdout and not r.stderr
