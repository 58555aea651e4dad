"""The engine on fake workspaces: groups, rewards, limits, failure isolation, output rows."""

from __future__ import annotations

import asyncio
import json

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout import (
    CallablePolicy,
    PolicyContext,
    RolloutEngine,
    Status,
    TraceReplayPolicy,
    parse_traces,
)
from bunshin.rollout.records import ToolCall
from bunshin.rollout.task import TaskSpec

from .fakes import FakeEnv, FakeTools

TASK = TaskSpec(id="t1", prompt="go", reward="score", max_turns=4, trajectory_timeout=5)


def traces_for(n: int) -> TraceReplayPolicy:
    lines = [json.dumps({"id": f"tr{i}", "steps": [
        {"think_s": 0.01, "name": "echo", "arguments": {"text": "hi"}},
        {"think_s": 0.01, "name": "write", "arguments": {"path": "/score", "content": str(i)}},
    ]}) for i in range(n)]
    return TraceReplayPolicy(parse_traces(lines))


def run(engine_kw: dict, coro_fn):
    async def go():
        async with RolloutEngine(**engine_kw) as engine:
            return await coro_fn(engine)
    return asyncio.run(go())


def make(envs: list, tools: FakeTools, **kw):
    def factory(task):
        env = FakeEnv(task, tools, **kw)
        envs.append(env)
        return env
    return factory


def test_group_rewards_rows_and_cleanup():
    tools, envs = FakeTools(), []
    g = run({"mode": "bunshin", "tools": tools, "env_factory": make(envs, tools)},
            lambda e: e.run_group(TASK, traces_for(4), 4))
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * 4
    assert g.rewards == [0.0, 1.0, 2.0, 3.0] and g.failed == 0
    env = envs[0]
    assert env.prepared == 1 and sorted(env.closed) == sorted(env.opened) and env.released
    t = g.trajectories[1]
    row = json.loads(json.dumps(t.to_row()))
    assert row["task_id"] == "t1" and row["group_id"] == g.group_id and row["trajectory_id"] == f"{g.group_id}-1"
    assert row["mode"] == "bunshin" and row["index"] == 1 and row["turns"] == 2 and row["reward"] == 1.0
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert row["steps"][0]["tool_call"]["name"] == "echo" and row["steps"][0]["observation"]["output"] == "hi"
    assert row["steps"][0]["think_s"] >= 0.01 and row["timings"]["think_s"] >= 0.02
    assert row["messages"][2]["tool_call_id"] == row["messages"][1]["tool_calls"][0]["id"]


def test_task_root_is_reused_across_groups():
    tools, envs = FakeTools(), []

    async def two(engine):
        await engine.run_group(TASK, traces_for(2), 2)
        return await engine.run_group(TASK, traces_for(2), 2)

    run({"tools": tools, "env_factory": make(envs, tools)}, two)
    assert len(envs) == 1 and envs[0].prepared == 1 and len(envs[0].opened) == 4


def test_concurrency_limit():
    tools, envs = FakeTools(), []
    pol = CallablePolicy(lambda c: [ToolCall("sleep", {"s": 0.05})] if c.turn == 0 else None)
    g = run({"tools": tools, "concurrency": 2, "env_factory": make(envs, tools)}, lambda e: e.run_group(TASK, pol, 6))
    assert g.failed == 0 and envs[0].max_in_flight == 2
    assert max(t.timings.queued_s for t in g.trajectories) > 0.05


def test_failures_are_isolated():
    """A crashed workspace, a timed-out trajectory and a failed start; the rest of the group finishes."""
    tools, envs = FakeTools(), []
    task = TaskSpec(id="t1", reward="score", trajectory_timeout=0.5)

    def act(c: PolicyContext):
        if c.turn > 0:
            return None
        return {1: [ToolCall("crash", {})], 2: [ToolCall("sleep", {"s": 30})]}.get(
            c.index, [ToolCall("write", {"path": "/score", "content": "1"})])

    g = run({"tools": tools, "env_factory": make(envs, tools, fail_open={3})},
            lambda e: e.run_group(task, CallablePolicy(act), 5))
    st = [t.status for t in g.trajectories]
    assert st == [Status.COMPLETED, Status.ERROR, Status.TIMEOUT, Status.ERROR, Status.COMPLETED]
    assert "agent vanished" in g.trajectories[1].error and "0.5s" in g.trajectories[2].error
    assert "could not start" in g.trajectories[3].error
    assert g.rewards == [1.0, None, None, None, 1.0] and g.failed == 3
    assert sorted(envs[0].closed) == sorted(envs[0].opened)  # the timed-out workspace is closed too


def test_prepare_failure_fails_every_trajectory_but_returns():
    tools, envs = FakeTools(), []
    g = run({"tools": tools, "env_factory": make(envs, tools, fail_prepare=True)},
            lambda e: e.run_group(TASK, traces_for(1), 3))
    assert [t.status for t in g.trajectories] == [Status.ERROR] * 3
    assert "setup exploded" in g.trajectories[0].error


def test_max_turns_unknown_tool_and_no_reward():
    tools, envs = FakeTools(), []
    forever = CallablePolicy(lambda c: [ToolCall("nope", {})])
    task = TaskSpec(id="t1", max_turns=3, tools=("echo",))
    g = run({"tools": tools, "env_factory": make(envs, tools)}, lambda e: e.run_group(task, forever, 1))
    t = g.trajectories[0]
    assert t.status == Status.MAX_TURNS and len(t.steps) == 3 and t.reward is None
    assert "unknown tool 'nope'" in t.steps[0].observation.error and not tools.calls


def test_bad_tool_list_and_group_size():
    tools, envs = FakeTools(), []
    with pytest.raises(InvalidArgument, match="field 'tools': unknown tool 'bash'"):
        run({"tools": tools, "env_factory": make(envs, tools)},
            lambda e: e.run_group(TaskSpec(id="x", tools=("bash",)), traces_for(1), 1))
    with pytest.raises(InvalidArgument, match="group size"):
        run({"tools": tools, "env_factory": make(envs, tools)}, lambda e: e.run_group(TASK, traces_for(1), 0))
    with pytest.raises(InvalidArgument, match="unknown mode"):
        RolloutEngine("fast")


def test_events_and_several_tasks():
    tools, envs, events = FakeTools(), [], []
    tasks = [TASK, TaskSpec(id="t2", reward="score")]
    groups = run({"tools": tools, "env_factory": make(envs, tools), "on_event": lambda k, i: events.append(k)},
                 lambda e: e.run(tasks, traces_for(2), 2))
    assert [g.task_id for g in groups] == ["t1", "t2"] and all(g.failed == 0 for g in groups)
    assert events.count("trajectory_end") == 4 and events.count("group_end") == 2
    assert events.count("prepare_start") == 2


def test_cancel_closes_workspaces():
    tools, envs = FakeTools(), []
    pol = CallablePolicy(lambda c: [ToolCall("sleep", {"s": 30})])

    async def go():
        async with RolloutEngine(tools=tools, env_factory=make(envs, tools)) as engine:
            task = asyncio.ensure_future(engine.run_group(TASK, pol, 3))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert len(envs[0].opened) == 3 and sorted(envs[0].closed) == sorted(envs[0].opened)


def test_scope_tools_restricts_and_sets_timeouts():
    from bunshin.rollout.envs import ModeOptions, scope_tools
    from bunshin.tools import ToolSet

    task = TaskSpec(id="t", tools=("bash", "python"), call_timeout=7, workdir="/work")
    scoped = scope_tools(ToolSet.default(), task)
    assert [t.name for t in scoped] == ["bash", "python"] and scoped.workdir == "/work"
    assert {t.spec.timeout for t in scoped} == {7}
    fake = FakeTools()
    assert scope_tools(fake, task) is fake
    assert ModeOptions(cache=False).effective("bunshin") == {"fork": True, "cache": False, "speculation": False}
    assert ModeOptions().effective("baseline") == {"fork": False, "cache": False, "speculation": False}
