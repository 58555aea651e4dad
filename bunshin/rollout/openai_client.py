"""A policy backed by an OpenAI-compatible chat-completions endpoint (vLLM, SGLang, OpenAI).

``POST {base_url}/chat/completions`` through the ``openai`` SDK's async client, with
the chat so far and the task's tools; the answer's ``tool_calls`` become the next
calls, an answer without any ends the trajectory. The SDK retries transient
failures (connection errors, timeouts, 408/409/429/5xx) ``retries`` times with its
exponential backoff (0.5 s doubling, jittered, at most 8 s; ``Retry-After`` honoured);
anything else, or running out of retries, raises :class:`~bunshin.errors.PolicyError`.
No key, no ``Authorization`` header (local servers); the SDK never reads
``OPENAI_API_KEY`` for this policy. ``openai`` is imported when a policy is made.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import httpx

from ..errors import PolicyError
from .policies import PolicyContext
from .records import Action, ToolCall

if TYPE_CHECKING:
    import openai

#: The SDK's request header numbering the attempts of one call (0 for the first).
_RETRY_COUNT_HEADER = "x-stainless-retry-count"
_NO_KEY = "unused"  # the SDK wants a key; with none its Authorization header is omitted


def _retried_by_sdk(status: int) -> bool:
    """The statuses the SDK retries (unless the server says ``x-should-retry``)."""
    return status in (408, 409, 429) or status >= 500


class OpenAIPolicy:
    """Chat completions with tool calling, one request per turn.

    ``requests`` counts the HTTP requests sent, ``retried`` those that were retries.
    ``backoff_s`` is accepted for compatibility; the SDK's backoff applies.
    ``transport`` (tests) routes the requests through an ``httpx`` transport.
    """

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
        import openai

        self.name = f"openai:{model}"
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.retries = retries
        self.backoff_s = backoff_s
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice  # None: leave it to the server's default
        # the SDK also takes an httpx client (its "legacy" path), though typed for httpx2
        http_client: Any = httpx.AsyncClient(transport=transport) if transport is not None else None
        self._client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=api_key or _NO_KEY, max_retries=retries,
            timeout=openai.Timeout(timeout, connect=min(timeout, 10.0)), http_client=http_client)
        self._headers: dict[str, str | openai.Omit] = {} if api_key else {"Authorization": openai.omit}
        self.requests = 0
        self.retried = 0

    async def aclose(self) -> None:
        await self._client.close()

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

    def _count(self, retries_taken: int) -> None:
        self.requests += retries_taken + 1
        self.retried += retries_taken

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as the request's JSON, exactly (``extra_body``); the answer's JSON."""
        import openai

        url = f"{self.base_url}/chat/completions"
        rest = dict(body)
        model, messages = rest.pop("model"), rest.pop("messages")
        try:
            raw = await self._client.chat.completions.with_raw_response.create(
                model=model, messages=messages, extra_body=rest, extra_headers=self._headers)
        except openai.APIStatusError as e:
            taken = _retries_taken(e.response.request)
            self._count(taken)
            last = f"HTTP {e.status_code}: {e.response.text[:300]}"
            if taken < self.retries or not _retried_by_sdk(e.status_code):
                raise PolicyError(f"chat completion failed: {last}",
                                  hint=f"check the endpoint {url} and the model name") from None
            raise self._gave_up(last) from None
        except openai.APIConnectionError as e:  # APITimeoutError too
            self._count(_retries_taken(e.request))
            cause = e.__cause__ or e
            raise self._gave_up(f"{type(cause).__name__}: {cause}") from None
        self._count(raw.retries_taken)
        try:
            data = json.loads(raw.http_response.text)
        except json.JSONDecodeError:
            raise PolicyError(f"{url} answered {raw.http_response.status_code} with a body that is not JSON") from None
        return data  # parse_completion says what is wrong with an answer of another shape

    def _gave_up(self, last: str) -> PolicyError:
        return PolicyError(f"chat completion failed after {self.retries + 1} attempts: {last}",
                           hint=f"is the server at {self.base_url} up?")


def _retries_taken(request: Any) -> int:
    """How many retries came before ``request`` (the SDK numbers its attempts)."""
    try:
        return int(request.headers.get(_RETRY_COUNT_HEADER, "0"))
    except ValueError:
        return 0


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
