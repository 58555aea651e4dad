"""Bad input is refused with one clear line naming the fix, and loses nothing.

Each case through the Python API and the ``bunshin`` command line (a subprocess of
``.venv/bin/bunshin`` with a private home): garbage trace files, out-of-range
timeouts, an empty image, memory limits the host cannot give or the agent cannot
live in; and exec output as exact bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bunshin.config import Config
from bunshin.errors import BunshinError, InvalidArgument
from bunshin.rollout.policies import TraceReplayPolicy
from bunshin.rollout.task import parse_task
from bunshin.runtime.container.cgroups import MIN_MEMORY, parse_size
from bunshin.runtime.kernel.limits import MAX_TIMEOUT_S, check_timeout
from bunshin.workspace import Workspace
from tests.conftest import drop_state_tmpfs, leftovers

BUNSHIN = Path(sys.executable).parent / "bunshin"


def cli(cfg, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu), "BUNSHIN_TMPFS": str(cfg.tmpfs)}
    return subprocess.run([str(BUNSHIN), *args], capture_output=True, env=env, timeout=timeout)


def refused(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A non-zero exit with a short error (no traceback) that holds every needle."""
    err = proc.stderr.decode(errors="replace")
    assert proc.returncode != 0, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) <= 3, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture(scope="module")
def ws_cfg(tmp_path_factory):
    """A home of its own for the shared workspace, so ``no_leaks`` of the other tests does not see it."""
    config = Config.for_home(tmp_path_factory.mktemp("bunshin-bad-input"), criu=Config.from_env().criu)
    yield config
    drop_state_tmpfs(config)


@pytest.fixture(scope="module")
def ws(ws_cfg):
    w = Workspace.create("host", memory="256M", pids=64, config=ws_cfg)
    yield w
    w.remove()
    assert not any(leftovers(ws_cfg).get(k) for k in ("records", "mounts", "cgroups", "folders"))


# --- 1. garbage trace files --------------------------------------------------------------

GARBAGE = {
    "binary": (b"\xff\xfe\x00\x81garbage\n", 1, "not UTF-8"),
    "tool_call_int": (b'{"tool_call": 5}\n', 1, "'tool_call' must be an object"),
    "array": (b'{"name": "bash", "arguments": {}}\n[1, 2]\n', 2, "expected an object"),
    "string_line": (b'"just a string"\n', 1, "expected an object"),
    "not_json": (b'{"name": "bash"}\n\n{oops\n', 3, "not JSON"),
    "missing_name": (b'{"arguments": {"command": "ls"}}\n', 1, "'name' missing"),
    "step_not_object": (b'{"steps": [{"name": "bash"}, 7]}\n', 1, "step 1: a step must be an object"),
    "final_not_object": (b'{"steps": [], "final": "done"}\n', 1, "'final' must be an object"),
    "final_think_text": (b'{"steps": [], "final": {"think_s": "soon"}}\n', 1, "final.think_s"),
    "think_inf": (b'{"name": "bash", "think_s": 1e999}\n', 1, "think_s"),
    "task_not_string": (b'{"name": "bash", "task": 5}\n', 1, "'task' must be a string"),
    "deep": (b"[" * 100_000 + b"\n", 1, "nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_traces_name_file_and_line(tmp_path, case):
    data, line, message = GARBAGE[case]
    path = tmp_path / "traces.jsonl"
    path.write_bytes(data)
    with pytest.raises(InvalidArgument) as e:
        TraceReplayPolicy.from_file(path)
    assert f"{path} line {line}" in str(e.value) and message in str(e.value)
    assert path.read_bytes() == data  # the file is left as it was


@pytest.mark.parametrize("case", ["binary", "tool_call_int", "array", "missing_name"])
def test_cli_rollout_refuses_garbage_traces(cfg, tmp_path, case):
    data, line, message = GARBAGE[case]
    task = tmp_path / "task.json"
    task.write_text(json.dumps({"id": "t"}))
    traces = tmp_path / "traces.jsonl"
    traces.write_bytes(data)
    out = tmp_path / "out.jsonl"
    r = cli(cfg, "rollout", str(task), "--policy", str(traces), "--out", str(out))
    refused(r, f"line {line}", message, "traces.jsonl")
    assert not out.exists()


# --- 2. timeouts -----------------------------------------------------------------------

BAD_TIMEOUTS = [float("inf"), float("-inf"), float("nan"), -1.0, 0.0, 1e12, MAX_TIMEOUT_S * 2]


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_check_timeout(value):
    with pytest.raises(InvalidArgument, match="out of range"):
        check_timeout(value)


def test_check_timeout_accepts_the_range():
    assert check_timeout(None) is None
    assert check_timeout(0.01) == 0.01 and check_timeout(MAX_TIMEOUT_S) == MAX_TIMEOUT_S
    with pytest.raises(InvalidArgument):
        check_timeout("10")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        check_timeout(True)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["call_timeout", "trajectory_timeout"])
@pytest.mark.parametrize("value", ["inf", "nan", -5, 1e12])
def test_task_spec_timeouts(field, value):
    with pytest.raises(InvalidArgument, match=f"field '{field}'"):
        parse_task({"id": "t", field: value})
    assert getattr(parse_task({"id": "t", field: 3600}), field) == 3600


@pytest.mark.integration
def test_exec_and_session_timeouts(ws):
    for value in (float("inf"), float("nan"), -1.0, 1e12):
        with pytest.raises(InvalidArgument, match="out of range"):
            ws.exec("true", timeout=value)
        with pytest.raises(InvalidArgument):
            ws.agent().exec(cmd="true", timeout=value if value != 1e12 else float("inf"))
    with ws.shell() as sh:
        with pytest.raises(InvalidArgument, match="out of range"):
            sh.run("true", timeout=float("inf"))
        assert sh.run("echo alive", timeout=10).output.strip() == "alive"  # the session lives on
    assert ws.exec("echo ok", timeout=10).stdout == "ok\n"


@pytest.mark.integration
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e12"])
def test_cli_exec_timeout(ws_cfg, ws, value):
    r = cli(ws_cfg, "exec", ws.id, "--timeout", value, "--", "true")
    refused(r, "--timeout", "7 days")


# --- 3. an empty image ------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("image", ["", "   ", "\t"])
def test_empty_image_refused(no_leaks, image, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # it used to become the root: the current folder
    with pytest.raises(InvalidArgument, match="empty"):
        Workspace.create(image, config=no_leaks)
    refused(cli(no_leaks, "create", "--image", image), "empty", "host")
    assert Workspace.list(config=no_leaks) == []


# --- 4. memory limits -------------------------------------------------------------------


def test_parse_size_bounds():
    total = psutil.virtual_memory().total
    with pytest.raises(InvalidArgument, match="more than this host"):
        parse_size("1TB" if total < 1 << 40 else "1024TB")
    with pytest.raises(InvalidArgument, match="more than this host"):
        parse_size(total + 1)
    for small in ("1k", "1", "31M", MIN_MEMORY - 1):
        with pytest.raises(InvalidArgument, match="too small") as e:
            parse_size(small)
        assert e.value.hint and "32M" in e.value.hint
    for bad in ("inf", "nan", "1e999G", "", "lots"):
        with pytest.raises(InvalidArgument, match="malformed"):
            parse_size(bad)
    assert parse_size("32M") == MIN_MEMORY and parse_size(None) is None and parse_size("1G") == 1 << 30


@pytest.mark.integration
@pytest.mark.parametrize("memory, message", [("1TB", "more than this host"), ("1k", "too small"),
                                             ("1000T", "more than this host")])
def test_cli_create_memory_refused(no_leaks, memory, message):
    refused(cli(no_leaks, "create", "--memory", memory), message, "give ")
    with pytest.raises(InvalidArgument, match=message):
        Workspace.create("host", memory=memory, config=no_leaks)
    assert Workspace.list(config=no_leaks) == []


@pytest.mark.integration
def test_the_minimum_memory_is_enough(no_leaks):
    """A workspace at the minimum starts, runs a shell and Python, forks nothing (just lives)."""
    with Workspace.create("host", memory=MIN_MEMORY, pids=64, config=no_leaks) as w:
        r = w.exec(["sh", "-c", "python3 -c 'print(sum(range(10**6)))'; echo done"], timeout=60)
        assert r.ok and r.stdout == "499999500000\ndone\n", r
        assert w.stats().memory.cgroup_bytes < MIN_MEMORY


# --- 5. exec output as bytes ------------------------------------------------------------

ALL_BYTES = bytes(range(256)) * 4 + b"\xff\xfe\r\n\x00"


@pytest.mark.integration
def test_exec_bytes_mode(ws):
    ws.files.write("/tmp/blob", ALL_BYTES)
    r = ws.exec(["sh", "-c", "cat /tmp/blob; cat /tmp/blob >&2; exit 3"], text=False)
    assert r.stdout == ALL_BYTES and r.stderr == ALL_BYTES and r.exit_code == 3
    assert isinstance(r.stdout, bytes) and not r.stdout_truncated
    empty = ws.exec("true", text=False)
    assert empty.stdout == b"" and empty.stderr == b""
    # the default stays text (undecodable bytes replaced)
    t = ws.exec(["sh", "-c", "printf 'a\\377b'"])
    assert t.stdout == "a\ufffdb"
    # truncation: the kept prefix exactly, flagged, no note appended
    big = ws.commands.run(["cat", "/tmp/blob"], text=False, max_output=100)
    assert big.stdout == ALL_BYTES[:100] and big.stdout_truncated


@pytest.mark.integration
def test_cli_exec_passes_bytes_through(ws_cfg, ws):
    ws.files.write("/tmp/blob", ALL_BYTES)
    r = cli(ws_cfg, "exec", ws.id, "--", "sh", "-c", "cat /tmp/blob; cat /tmp/blob >&2")
    assert r.returncode == 0 and r.stdout == ALL_BYTES and r.stderr == ALL_BYTES


def test_errors_are_bunshin_errors():
    assert issubclass(InvalidArgument, BunshinError) and issubclass(InvalidArgument, ValueError)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1, 1e12])
def test_a_tool_with_a_bad_timeout_is_refused(timeout):
    from bunshin.tools import ToolSpec

    with pytest.raises(InvalidArgument, match="timeout of tool 'grep'"):
        ToolSpec("grep", "search", {"type": "object"}, timeout=timeout)
