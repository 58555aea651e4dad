"""Typed records of a rollout: actions a policy takes, what each tool call saw, trajectories and groups.

Every record turns into plain JSON with :func:`bunshin.console.to_jsonable`; one
trajectory is one JSONL row (:meth:`TrajectoryResult.to_row`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..console import to_jsonable


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class ToolCall:
    """One call the policy asked for; ``id`` ties it to its tool message."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("call"))

    def openai(self) -> dict[str, Any]:
        import json

        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass(frozen=True)
class Action:
    """What a policy decided in one turn: tool calls, or none (the trajectory ends).

    ``think_s`` is how long the policy took (real waiting, measured by the engine
    when zero). ``message`` is the assistant message as the model produced it.
    """

    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None
    think_s: float = 0.0
    message: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        return not self.tool_calls

    def assistant_message(self) -> dict[str, Any]:
        if self.message is not None:
            return self.message
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [c.openai() for c in self.tool_calls]
        return msg


@dataclass(frozen=True)
class StepObservation:
    """What one tool call returned (the fields of ``bunshin.tools.Observation``)."""

    output: str
    exit_code: int | None = None
    error: str | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    cached: bool = False
    speculated: bool = False

    @classmethod
    def of(cls, obs: Any) -> StepObservation:
        """Copy any observation-like object (duck-typed on the field names)."""
        return cls(output=str(getattr(obs, "output", "")), exit_code=getattr(obs, "exit_code", None),
                   error=getattr(obs, "error", None), timed_out=bool(getattr(obs, "timed_out", False)),
                   duration_s=float(getattr(obs, "duration_s", 0.0)), cached=bool(getattr(obs, "cached", False)),
                   speculated=bool(getattr(obs, "speculated", False)))

    def text(self) -> str:
        """The tool message a model reads."""
        parts = [self.output]
        if self.timed_out:
            parts.append("[timed out]")
        elif self.exit_code not in (None, 0):
            parts.append(f"[exit code {self.exit_code}]")
        if self.error:
            parts.append(f"[error: {self.error}]")
        return "\n".join(p for p in parts if p)


@dataclass(frozen=True)
class Step:
    """One tool call of a trajectory: when the policy asked, what came back, how long it took."""

    turn: int
    think_s: float
    tool_call: ToolCall
    observation: StepObservation
    latency_s: float


class Status(StrEnum):
    """How a trajectory ended. Only ``completed`` and ``max_turns`` carry a reward."""

    COMPLETED = "completed"  # the policy stopped calling tools
    MAX_TURNS = "max_turns"  # truncated at the task's max_turns
    TIMEOUT = "timeout"  # ran past the task's trajectory_timeout
    ERROR = "error"  # setup, workspace, policy or reward failed


@dataclass(frozen=True)
class Timings:
    """Seconds spent per phase of one trajectory; ``total_s`` is wall time from start to reward."""

    queued_s: float = 0.0
    env_s: float = 0.0  # getting a workspace: create + setup, or restore / fork
    think_s: float = 0.0
    tools_s: float = 0.0
    reward_s: float = 0.0
    total_s: float = 0.0
    started_at: float = 0.0


@dataclass(frozen=True)
class TrajectoryResult:
    """One trajectory, as a trainer loads it."""

    run_id: str
    task_id: str
    group_id: str
    trajectory_id: str
    index: int
    mode: str
    options: dict[str, Any]
    status: Status
    reward: float | None
    messages: list[dict[str, Any]]
    steps: list[Step]
    timings: Timings
    error: str | None = None
    policy: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (Status.COMPLETED, Status.MAX_TURNS) and self.reward is not None

    def to_row(self) -> dict[str, Any]:
        row = to_jsonable(self)
        row["turns"] = len({s.turn for s in self.steps})
        return row


@dataclass(frozen=True)
class GroupResult:
    """The N trajectories of one task; ``makespan_s`` from the first start to the last reward."""

    run_id: str
    task_id: str
    group_id: str
    mode: str
    trajectories: list[TrajectoryResult]
    makespan_s: float
    prepare_s: float  # preparing the task root (bunshin and copy modes), 0 in baseline

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]

    @property
    def failed(self) -> int:
        return sum(not t.ok for t in self.trajectories)
