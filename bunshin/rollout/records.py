"""Typed records of a rollout: actions a policy takes, trajectories and groups.

A tool call, what it returned and the step recording both are the tools layer's
(:class:`~bunshin.tools.ToolCall`, :class:`~bunshin.tools.Observation`,
:class:`~bunshin.tools.Step`), shared with the prefix cache and speculation.
Every record turns into plain JSON with :func:`bunshin.console.to_jsonable`; one
trajectory is one JSONL row (:meth:`TrajectoryResult.to_row`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..console import to_jsonable
from ..tools.spec import Observation, Step, ToolCall

__all__ = ["Action", "GroupResult", "Observation", "Status", "Step", "StepObservation", "Timings", "ToolCall",
           "TrajectoryResult", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


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


StepObservation = Observation
"""The old name of :class:`bunshin.tools.Observation` (tests import it)."""


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
    #: where it ran, when an env placed it (``bunshin.cluster``): host, hosts, retries, events
    placement: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status in (Status.COMPLETED, Status.MAX_TURNS) and self.reward is not None

    def to_row(self) -> dict[str, Any]:
        row = to_jsonable(self)
        for step in row["steps"]:  # a row's calls in the wire form: the cache key is the cache's
            del step["tool_call"]["key"]
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
