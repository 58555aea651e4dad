"""Trace replay and callable policies."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout.policies import (
    CallablePolicy,
    PolicyContext,
    TraceReplayPolicy,
    as_action,
    parse_traces,
)
from bunshin.rollout.records import Action, ToolCall
from bunshin.rollout.task import TaskSpec

TASK = TaskSpec(id="t1")


def ctx(index: int = 0, state: dict | None = None) -> PolicyContext:
    return PolicyContext(task=TASK, index=index, turn=0, messages=[], tools=[], state={} if state is None else state)


def test_whole_and_step_line_traces():
    lines = [
        json.dumps({"id": "a", "task": "t1", "steps": [{"think_s": 0.01, "name": "echo", "arguments": {"text": "x"}}],
                    "final": {"content": "bye"}}),
        json.dumps({"trace": "b", "think_s": 0, "name": "echo", "arguments": "{\"text\": \"y\"}"}),
        json.dumps({"trace": "b", "tool_call": {"name": "write", "arguments": {"path": "/p", "content": "1"}}}),
        "",
    ]
    traces = parse_traces(lines)
    assert [t.id for t in traces] == ["a", "b"]
    assert traces[1].steps[0].arguments == {"text": "y"} and traces[1].steps[1].name == "write"
    assert traces[0].final_content == "bye"


@pytest.mark.parametrize("line, msg", [
    ("{not json", "not JSON"),
    ("[1]", "expected an object"),
    (json.dumps({"steps": [{"arguments": {}}]}), "'name' missing"),
    (json.dumps({"steps": [{"name": "x", "think_s": -1}]}), "think_s"),
    (json.dumps({"steps": [{"name": "x", "arguments": [1]}]}), "'arguments' must be an object"),
    (json.dumps({"steps": 3}), "'steps' must be a list"),
])
def test_bad_traces(line, msg):
    with pytest.raises(InvalidArgument, match=msg):
        parse_traces([line])


def test_no_traces():
    with pytest.raises(InvalidArgument, match="no traces"):
        parse_traces(["", "  "])


def test_replay_waits_think_time_and_round_robins():
    traces = parse_traces([
        json.dumps({"id": "a", "steps": [{"think_s": 0.2, "name": "echo", "arguments": {"text": "a"}}]}),
        json.dumps({"id": "b", "steps": [{"name": "echo", "arguments": {"text": "b"}}]}),
        json.dumps({"id": "c", "task": "other", "steps": [{"name": "echo", "arguments": {"text": "c"}}]}),
    ])
    pol = TraceReplayPolicy(traces, think_scale=0.5)
    assert pol.trace_for("t1", 0).id == "a" and pol.trace_for("t1", 1).id == "b" and pol.trace_for("t1", 2).id == "a"

    async def go():
        state: dict = {}
        t0 = time.perf_counter()
        a1 = await pol.act(ctx(0, state))
        waited = time.perf_counter() - t0
        a2 = await pol.act(ctx(0, state))
        return a1, a2, waited

    a1, a2, waited = asyncio.run(go())
    assert a1.tool_calls[0].arguments == {"text": "a"} and 0.09 < waited < 0.5 and a1.think_s == pytest.approx(0.1)
    assert a2.final
    with pytest.raises(InvalidArgument, match="no trace for task"):
        TraceReplayPolicy(traces[2:]).trace_for("t1", 0)


def test_callable_policy_sync_and_async():
    def sync_fn(c: PolicyContext):
        return [{"name": "echo", "arguments": {"text": str(c.index)}}] if c.turn == 0 else None

    async def async_fn(c: PolicyContext):
        return ToolCall("echo", {"text": "z"})

    a = asyncio.run(CallablePolicy(sync_fn).act(ctx(3)))
    assert a.tool_calls[0].arguments == {"text": "3"}
    b = asyncio.run(CallablePolicy(async_fn).act(ctx()))
    assert b.tool_calls[0].name == "echo"
    assert as_action(None).final and as_action("done").content == "done"
    assert as_action(Action()).final
    with pytest.raises(InvalidArgument):
        as_action([42])
