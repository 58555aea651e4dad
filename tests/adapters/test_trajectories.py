"""What the adapters share: tool calls parsed from model text, ids, the background loop, lazy imports."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from bunshin.adapters.trajectories import LOOP, BackgroundLoop, parse_calls, safe_id
from bunshin.errors import InvalidArgument, StateConflict
from bunshin.tools import ToolCall


def test_parse_calls_forms():
    tagged = 'thinking...\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' \
             '<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a\\"}"}</tool_call>'
    assert parse_calls(tagged) == [ToolCall("bash", {"command": "ls"}), ToolCall("read_file", {"path": "a"})]
    assert parse_calls('{"name": "bash", "parameters": {"command": "x"}}') == [ToolCall("bash", {"command": "x"})]
    assert parse_calls('[{"name": "a"}, {"name": "b", "arguments": {}}]') == [ToolCall("a", {}), ToolCall("b", {})]
    for final in ("The answer is 4.", '{"answer": 4}', "{not json", "[1, 2]", ""):
        assert parse_calls(final) == []  # a final answer, not a call


@pytest.mark.parametrize(("text", "why"), [
    ("<tool_call>{oops}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a 'name'"),
    ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be an object"),
    ('<tool_call>{"name": "bash", "arguments": "{bad"}</tool_call>', "not JSON"),
])
def test_broken_calls_say_what_is_wrong(text, why):
    with pytest.raises(InvalidArgument, match=why) as e:
        parse_calls(text)
    assert e.value.hint


def test_safe_id():
    assert safe_id("django__django-1234") == "django__django-1234"
    assert safe_id("a b/c") == "a_b_c" and len(safe_id("x" * 500)) == 128
    with pytest.raises(InvalidArgument):
        safe_id("")


def test_background_loop_runs_from_threads_and_inside_a_running_loop():
    loop = BackgroundLoop()
    try:
        async def answer() -> int:
            await asyncio.sleep(0)
            return 42

        assert loop.run(answer()) == 42

        async def framework_calls_a_sync_step() -> int:  # as SkyRL does without an env executor
            return loop.run(answer())

        assert asyncio.run(framework_calls_a_sync_step()) == 42

        async def from_inside() -> None:
            loop.run(answer())

        with pytest.raises(StateConflict, match="own event loop"):
            loop.run(from_inside())
    finally:
        loop.stop()
    assert LOOP is not loop


def test_import_bunshin_loads_no_framework():
    code = ("import sys, bunshin, bunshin.adapters, bunshin.adapters.trajectories; "
            "print(sorted(m for m in ('gymnasium', 'skyrl_gym', 'trl', 'torch', 'transformers', 'openenv', "
            "'minisweagent', 'swerex', 'verl', 'harbor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


EXITS = r"""
import sys
sys.path.insert(0, sys.argv[1])
from tests.adapters.conftest import TASK
from bunshin.adapters.trajectories import open_trajectory
traj = open_trajectory(TASK)
print(traj.call("bash", {"command": "cat setup.id"}).output.strip())
traj.close()  # the task root is left for the exit hook to free
"""


@pytest.mark.integration
@pytest.mark.criu
def test_a_process_that_exits_frees_its_task_roots(home):
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "BUNSHIN_HOME": str(home.home)}
    out = subprocess.run([sys.executable, "-c", EXITS, repo], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and len(out.stdout.strip()) == 36, out.stderr[-2000:]
    assert "cleanup failed" not in out.stderr  # the no_leaks fixture checks that the root is gone


def _canary(tmp_path):
    secret = tmp_path / "host-secret"
    secret.mkdir()
    (secret / "canary").write_text("do not touch\n")
    return secret


@pytest.mark.parametrize("adapter", ["skyrl", "trl", "rllm"])
def test_a_dataset_row_cannot_reach_into_the_host(adapter, tmp_path, monkeypatch):
    """A row is data: its task may not mount a host folder (rw, to plant or steal files) nor boot a
    host folder as its image (to read it); the trainer's own task file may."""
    from bunshin.adapters.trajectories import row_task

    secret = _canary(tmp_path)
    base = {"id": "evil", "prompt": "x", "reward": "echo 1"}
    rows = [{**base, "mounts": [f"{secret}:/loot:rw"]}, {**base, "image": str(secret)},
            {**base, "image": f"./{secret.name}"}, {**base, "image": secret.name}]
    monkeypatch.chdir(tmp_path)  # so the bare relative name is a folder here
    for task in rows:
        with pytest.raises(InvalidArgument, match="mounts|host folder") as e:
            if adapter == "skyrl":
                import bunshin.adapters.skyrl as sk
                sk.BunshinTextEnv(env_config={}, extras={"task": task})
            elif adapter == "trl":
                from bunshin.adapters.trl import BunshinToolEnv
                BunshinToolEnv().reset(task=task)
            else:
                from bunshin.adapters.rllm import BunshinEnv
                BunshinEnv.from_dict({"task": task})
        assert "task_file" in e.value.hint
    assert (secret / "canary").read_text() == "do not touch\n" and sorted(p.name for p in secret.iterdir()) == ["canary"]
    # the trainer's own file is trusted as written; a registry reference is not a folder
    f = tmp_path / "task.json"
    f.write_text(json.dumps({"id": "mine", "mounts": [f"{secret}:/data"]}))
    assert row_task({"task_file": str(f)}).mounts
    assert row_task({"task": {**base, "image": "python:3.11-slim"}}).image == "python:3.11-slim"
