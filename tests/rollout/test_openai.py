"""The OpenAI-compatible policy: wire format, retries, errors (a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bunshin.errors import PolicyError
from bunshin.rollout import OpenAIPolicy, RolloutEngine, Status
from bunshin.rollout.openai_client import parse_completion
from bunshin.rollout.policies import PolicyContext
from bunshin.rollout.task import TaskSpec

from .fake_openai import FakeChatServer
from .fakes import FakeEnv, FakeTools

TASK = TaskSpec(id="t1", prompt="write the score", reward="score", system="you are terse")


def ctx() -> PolicyContext:
    return PolicyContext(task=TASK, index=0, turn=0, messages=TASK.initial_messages(), tools=FakeTools().openai_tools())


def test_parse_completion():
    a = parse_completion({"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "x1", "type": "function", "function": {"name": "echo", "arguments": "{\"text\": \"a\"}"}},
        {"id": "x2", "type": "function", "function": {"name": "echo", "arguments": "not json"}},
    ]}}]})
    assert [c.id for c in a.tool_calls] == ["x1", "x2"] and a.tool_calls[0].arguments == {"text": "a"}
    assert a.tool_calls[1].arguments == {"_unparsed": "not json"}
    assert a.message["tool_calls"][0]["function"]["name"] == "echo"
    assert parse_completion({"choices": [{"message": {"content": "bye"}}]}).final
    with pytest.raises(PolicyError, match="without choices"):
        parse_completion({"error": "x"})


def test_retries_then_succeeds_over_real_http():
    script = [[{"name": "echo", "arguments": {"text": "hi"}}]]
    with FakeChatServer(script, fail_first=2) as srv:
        async def go():
            async with OpenAIPolicy(srv.base_url, "m1", api_key="k", temperature=0.2, backoff_s=0.01) as pol:
                return await pol.act(ctx()), pol.retried
        action, retried = asyncio.run(go())
    assert retried == 2 and action.tool_calls[0].name == "echo"
    body = srv.requests[-1]["body"]
    assert body["model"] == "m1" and body["temperature"] == 0.2 and body["tools"][0]["type"] == "function"
    assert body["messages"][0] == {"role": "system", "content": "you are terse"}
    assert srv.requests[-1]["auth"] == "Bearer k"


def test_gives_up_and_does_not_retry_client_errors():
    with FakeChatServer([], fail_first=10) as srv:
        async def go():
            async with OpenAIPolicy(srv.base_url, "m", retries=1, backoff_s=0.01) as pol:
                await pol.act(ctx())
        with pytest.raises(PolicyError, match="after 2 attempts: HTTP 503"):
            asyncio.run(go())
    with FakeChatServer([]) as srv:
        async def go404():
            async with OpenAIPolicy(srv.base_url + "/wrong", "m", backoff_s=0.01) as pol:
                await pol.act(ctx())
        with pytest.raises(PolicyError, match="HTTP 404"):
            asyncio.run(go404())
        assert len(srv.requests) == 1


def test_connection_refused_and_timeout():
    async def refused():
        async with OpenAIPolicy("http://127.0.0.1:9/v1", "m", retries=1, backoff_s=0.01) as pol:
            await pol.act(ctx())
    with pytest.raises(PolicyError, match="ConnectError"):
        asyncio.run(refused())

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async def timeout():
        async with OpenAIPolicy("http://x/v1", "m", retries=0, transport=httpx.MockTransport(slow)) as pol:
            await pol.act(ctx())
    with pytest.raises(PolicyError, match="ReadTimeout"):
        asyncio.run(timeout())


def test_a_group_driven_by_the_endpoint():
    script = [[{"name": "echo", "arguments": {"text": "looking"}}],
              [{"name": "write", "arguments": {"path": "/score", "content": "0.5"}}]]
    tools = FakeTools()
    with FakeChatServer(script) as srv:
        async def go():
            async with OpenAIPolicy(srv.base_url, "m") as pol, RolloutEngine(
                    tools=tools, env_factory=lambda t: FakeEnv(t, tools)) as engine:
                return await engine.run_group(TASK, pol, 3)
        g = asyncio.run(go())
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * 3 and g.rewards == [0.5] * 3
    msgs = g.trajectories[0].messages
    assert msgs[-1] == {"role": "assistant", "content": "done"}
    assert msgs[3]["role"] == "tool" and msgs[3]["tool_call_id"] == "c0-0" and msgs[3]["content"] == "looking"
    last = srv.requests[-1]["body"]["messages"]
    assert json.loads(last[-2]["tool_calls"][0]["function"]["arguments"]) == {"path": "/score", "content": "0.5"}
