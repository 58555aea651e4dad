"""Integration: a tiny task run for real in every mode, failures, the Gym wrapper, an endpoint, the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from bunshin.rollout import (
    ModeOptions,
    OpenAIPolicy,
    RolloutEngine,
    RolloutEnv,
    Status,
    TraceReplayPolicy,
    parse_traces,
    rollout,
)
from bunshin.rollout.task import parse_task
from bunshin.tools import Tool, ToolOutput, ToolSet, ToolSpec
from bunshin.workspace import Workspace

from .fake_openai import FakeChatServer

pytestmark = [pytest.mark.integration, pytest.mark.criu]

TASK = parse_task({
    "id": "tiny",
    "memory": "512M",
    "files": {"/work/hello.txt": "hello\n"},
    "setup": ["echo setup-ran > /work/setup.log", {"tool": "python", "arguments": {"code": "base = 40"}}],
    "workdir": "/work",
    "prompt": "compute",
    "max_turns": 6,
    "reward": "cat /work/score",
    "call_timeout": 20,
    "trajectory_timeout": 60,
})


def traces(n: int) -> TraceReplayPolicy:
    return TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "task": "tiny", "steps": [
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "cat hello.txt setup.log; export K=7"}},
        {"think_s": 0.05, "name": "python", "arguments": {"code": f"base += {i}\nbase"}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "echo $K"}},
        {"think_s": 0.0, "name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base))"}},
    ]}) for i in range(n)]))


def check_group(g, n: int) -> None:
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * n, [t.error for t in g.trajectories]
    assert g.rewards == [40.0 + i for i in range(n)]
    for t in g.trajectories:
        outs = [s.observation.output for s in t.steps]
        assert outs[0] == "hello\nsetup-ran\n" and outs[1] == f"{40 + t.index}\n" and outs[2] == "7\n"


@pytest.mark.parametrize("mode, options", [
    ("baseline", None), ("copy", None), ("bunshin", ModeOptions(cache=False)),
    ("bunshin", ModeOptions(fork=False, cache=False)), ("bunshin", None),
])
def test_every_mode_gives_the_same_rewards(no_leaks, host, mode, options):
    g = asyncio.run(rollout(TASK, traces(3), 3, mode=mode, options=options, config=no_leaks, host=host))
    check_group(g, 3)
    assert all(t.mode == mode for t in g.trajectories)
    if mode != "baseline":
        assert g.prepare_s > 0


def _kill_workspace(ws, args, ctx) -> ToolOutput:
    if isinstance(ws, Workspace):  # from the host: the workspace's init dies with everything in it
        os.kill(ws.record.pid, signal.SIGKILL)
    else:  # a remote one: gone from under the engine
        ws.remove()
    return ToolOutput("killed")


KILL = Tool(ToolSpec("die", "kill the workspace", {"type": "object", "properties": {}}), _kill_workspace)


@pytest.mark.parametrize("mode, cache", [("baseline", False), ("copy", False), ("bunshin", False), ("bunshin", True)])
def test_failures_are_isolated(no_leaks, host, mode, cache):
    """Trajectory 1's call times out (reported, not fatal), 2 runs past its time, 3's workspace is killed."""
    task = TASK.model_copy(update={"call_timeout": 1.0, "trajectory_timeout": 8.0})
    steps = {
        1: [{"name": "bash", "arguments": {"command": "sleep 30"}}],
        2: [{"think_s": 30, "name": "bash", "arguments": {"command": "true"}}],
        3: [{"name": "die", "arguments": {}}, {"name": "bash", "arguments": {"command": "true"}}],
    }
    done = {"name": "bash", "arguments": {"command": "echo 1 > /work/score"}}
    pol = TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "steps": steps.get(i, []) + [done]})
                                          for i in range(4)]))
    tools = ToolSet.default().add(KILL)
    g = asyncio.run(rollout(task, pol, 4, mode=mode, tools=tools, config=no_leaks, host=host,
                            options=ModeOptions(cache=cache)))
    st = [t.status for t in g.trajectories]
    assert st == [Status.COMPLETED, Status.COMPLETED, Status.TIMEOUT, Status.ERROR], [t.error for t in g.trajectories]
    assert g.trajectories[1].steps[0].observation.timed_out and g.trajectories[1].reward == 1.0
    assert "8s" in g.trajectories[2].error
    assert g.rewards[0] == 1.0 and g.rewards[3] is None


def test_bad_setup_fails_the_group_cleanly(no_leaks, host):
    task = TASK.model_copy(update={"setup": parse_task({"id": "x", "setup": ["echo oops >&2; exit 3"]}).setup})
    for mode in ("baseline", "bunshin"):
        g = asyncio.run(rollout(task, traces(2), 2, mode=mode, config=no_leaks, host=host))
        assert [t.status for t in g.trajectories] == [Status.ERROR] * 2
        assert "setup step 0" in g.trajectories[0].error and "exited 3" in g.trajectories[0].error


def test_gym_wrapper(no_leaks):
    with RolloutEnv("bunshin", options=ModeOptions(cache=False), config=no_leaks) as env:
        for i in range(2):
            obs, info = env.reset(TASK, index=i)
            assert obs["messages"][-1]["content"] == "compute"
            obs, r, term, trunc, info = env.step({"name": "python", "arguments": {"code": f"base + {i}"}})
            assert obs["messages"][-1]["content"] == f"{40 + i}\n" and not term
            env.step({"name": "write_file", "arguments": {"path": "score", "content": str(i)}})
            obs, r, term, trunc, info = env.step(None)
            assert (r, term, trunc, info["status"]) == (float(i), True, False, "completed")


def test_openai_policy_drives_real_workspaces(no_leaks):
    script = [[{"name": "bash", "arguments": {"command": "cat setup.log"}}],
              [{"name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base + 2))"}}]]
    with FakeChatServer(script, fail_first=1) as srv:
        async def go():
            async with OpenAIPolicy(srv.base_url, "fake", backoff_s=0.01) as pol:
                return await rollout(TASK, pol, 2, mode="bunshin", config=no_leaks)
        g = asyncio.run(go())
    assert g.rewards == [42.0, 42.0] and g.trajectories[0].steps[0].observation.output == "setup-ran\n"
    assert g.trajectories[0].messages[-1] == {"role": "assistant", "content": "done"}
    tools = srv.requests[-1]["body"]["tools"]
    assert {t["function"]["name"] for t in tools} == {"bash", "read_file", "write_file", "edit", "python"}


def test_engine_keeps_the_task_root_for_later_groups(no_leaks, host):
    async def go():
        async with RolloutEngine("copy", config=no_leaks, host=host) as engine:
            a = await engine.run_group(TASK, traces(2), 2)
            b = await engine.run_group(TASK, traces(2), 2)
            return a, b
    a, b = asyncio.run(go())
    check_group(a, 2)
    check_group(b, 2)
    assert b.prepare_s == a.prepare_s  # prepared once


def _cli_inputs(tmp_path):
    """The task file and a trace file whose two trajectories score 40 and 41."""
    task = tmp_path / "task.json"
    task.write_text(json.dumps(TASK.model_dump(mode="json")))
    trace_file = tmp_path / "traces.jsonl"
    trace_file.write_text("\n".join(json.dumps({"id": f"t{i}", "steps": [
        {"name": "python", "arguments": {"code": f"open('/work/score', 'w').write(str(base + {i}))"}}]})
        for i in range(2)) + "\n")
    return task, trace_file


def test_cli_rollout(no_leaks, tmp_path, monkeypatch, capsys):
    from bunshin.cli.main import main

    monkeypatch.setenv("BUNSHIN_HOME", str(no_leaks.home))
    monkeypatch.setenv("BUNSHIN_CRIU", str(no_leaks.criu))
    task, trace_file = _cli_inputs(tmp_path)
    out = tmp_path / "out.jsonl"
    assert main(["rollout", str(task), "--policy", str(trace_file), "--group", "2", "--mode", "bunshin",
                 "--cache", "off", "--out", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["groups"][0]["ok"] == 2 and summary["groups"][0]["mean_reward"] == 40.5
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [40.0, 41.0] and {r["group_id"] for r in rows} == {rows[0]["group_id"]}
    replay = out.with_name("replay.jsonl")  # a rollout's own rows replay as traces
    assert main(["rollout", str(task), "--policy", f"trace:{out}", "--group", "2", "--mode", "copy",
                 "--out", str(replay)]) == 0
    assert [json.loads(x)["reward"] for x in replay.read_text().splitlines()] == [40.0, 41.0]


def test_host_folder_mounts_need_the_local_host(no_leaks, tmp_path):
    """A task sharing a host folder cannot run on a remote host: a clear error, nothing made."""
    from bunshin.client import Client
    from bunshin.errors import InvalidArgument
    from bunshin.rollout.envs import make_env

    task = TASK.model_copy(update={"mounts": (f"{tmp_path}:/data:ro",)})
    env = make_env("baseline", task, ToolSet.default(), no_leaks,
                   host=Client("http://127.0.0.1:9", token="t"))  # never called: refused before
    with pytest.raises(InvalidArgument, match="mounts need workspaces on this machine"):
        asyncio.run(env.open(0))


def test_cli_rollout_on_a_served_host(no_leaks, tmp_path, capsys):
    """``bunshin rollout --server URL``: the workspaces live on the server; same rewards."""
    from bunshin.cli.main import main
    from bunshin.server.thread import serve_in_thread

    from .conftest import TOKEN

    task, trace_file = _cli_inputs(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with serve_in_thread(no_leaks, TOKEN) as url:
        assert main(["rollout", str(task), "--policy", str(trace_file), "--group", "2", "--server", url,
                     "--token-file", str(token_file), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["groups"][0]["ok"] == 2 and summary["groups"][0]["mean_reward"] == 40.5
    # no token: a clear error, nothing made
    assert main(["rollout", str(task), "--policy", str(trace_file), "--server", "http://127.0.0.1:9",
                 "--token-file", str(tmp_path / "missing")]) != 0
    assert "cannot read the API token file" in capsys.readouterr().err
