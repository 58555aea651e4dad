"""A policy backed by an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, OpenAI).

``POST {base_url}/chat/completions`` with the chat so far and the task's tools;
the answer's ``tool_calls`` become the next calls, an answer without any ends the
trajectory. Transient failures (connection errors, timeouts, 408/409/429/5xx) are
retried with exponential backoff (honouring ``Retry-After``); anything else, or
running out of retries, raises :class:`~bunshin.errors.PolicyError`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from ..errors import PolicyError
from .policies import PolicyContext
from .records import Action, ToolCall

RETRY_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})


class OpenAIPolicy:
    """Chat completions with tool calling, one request per turn."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        extra_body: dict[str, Any] | None = None,
        tool_choice: str | None = "auto",
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = f"openai:{model}"
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.retries = retries
        self.backoff_s = backoff_s
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice  # None: leave it to the server's default
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                         headers=headers, transport=transport)
        self.requests = 0
        self.retried = 0

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> OpenAIPolicy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def request_body(self, ctx: PolicyContext) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": ctx.messages}
        if ctx.tools:
            body["tools"] = ctx.tools
            if self.tool_choice is not None:
                body["tool_choice"] = self.tool_choice
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    async def act(self, ctx: PolicyContext) -> Action:
        t0 = time.perf_counter()
        data = await self._post(self.request_body(ctx))
        return parse_completion(data, think_s=time.perf_counter() - t0)

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        url = f"{self.base_url}/chat/completions"
        last = ""
        for attempt in range(self.retries + 1):
            delay = self.backoff_s * 2**attempt * (0.5 + random.random())
            self.requests += 1
            try:
                resp = await self._client.post(url, json=body)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    try:
                        return resp.json()
                    except json.JSONDecodeError:
                        raise PolicyError(f"{url} answered 200 with a body that is not JSON") from None
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS:
                    raise PolicyError(f"chat completion failed: {last}", hint=f"check the endpoint {url} and the model name")
                after = resp.headers.get("retry-after")
                if after and after.replace(".", "", 1).isdigit():
                    delay = min(float(after), 60.0)
            if attempt < self.retries:
                self.retried += 1
                await asyncio.sleep(delay)
        raise PolicyError(f"chat completion failed after {self.retries + 1} attempts: {last}",
                          hint=f"is the server at {self.base_url} up?")


def parse_completion(data: dict[str, Any], *, think_s: float = 0.0) -> Action:
    """The :class:`Action` in a chat-completions answer (first choice)."""
    try:
        message = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise PolicyError(f"chat completion without choices[0].message: {str(data)[:300]}") from None
    calls = []
    for i, tc in enumerate(message.get("tool_calls") or []):
        fn = tc.get("function") or {}
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else dict(raw)
        except json.JSONDecodeError:
            args = {"_unparsed": raw}  # the tool reports the bad arguments back to the model
        if not isinstance(args, dict):
            args = {"_unparsed": raw}
        calls.append(ToolCall(str(fn.get("name", "")), args, id=str(tc.get("id") or f"call-{i}")))
    msg = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in calls
        ]
    return Action(tool_calls=tuple(calls), content=message.get("content"), think_s=think_s, message=msg)
