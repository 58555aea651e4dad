"""``POST /v1/rollouts``: a whole group run on the server against a policy endpoint."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .models import MAX_COUNT, Model


class PolicyEndpoint(Model):
    """An OpenAI-compatible chat-completions endpoint the server calls (``OpenAIPolicy``)."""

    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key: str | None = None
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    timeout: float = Field(default=120.0, gt=0, le=3600)
    retries: int = Field(default=3, ge=0, le=10)


class RunRollouts(Model):
    task: dict[str, Any]
    n: int = Field(ge=1, le=MAX_COUNT)
    policy: PolicyEndpoint
    mode: Literal["bunshin", "copy", "baseline"] = "bunshin"
    speculation: bool = True
    concurrency: int | None = Field(default=None, ge=1, le=MAX_COUNT)


class RolloutsOut(Model):
    run_id: str
    task_id: str
    group_id: str
    mode: str
    makespan_s: float
    prepare_s: float
    rewards: list[float | None]
    rows: list[dict[str, Any]]
