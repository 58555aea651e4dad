"""Typed requests and responses of groups and trajectories (pydantic), shared by server and client.

A group is the N trajectories of one rollout group, keyed by the caller's ``key``: its
root snapshot (a task's setup run once, a fresh ``host`` workspace, or a given snapshot)
and the prefix cache every trajectory of the key shares, whichever process asks. The
task travels as the JSON form of ``bunshin.rollout.TaskSpec`` (checked on the server,
which names the field at fault); the tool names are the built-in tools'.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..runtime.state.budget import MIN_PIDS, PID_MAX_LIMIT
from .models import MAX_COUNT, Model, ServedImage

#: A group key: it names the group in URLs and in the server's records.
KEY_PATTERN = r"^[A-Za-z0-9_.:-]+$"


class CreateGroup(Model):
    """Exactly one of ``image``, ``snapshot`` or ``task`` names the root, or a ``snapshot``
    with the ``task`` it is the root of (a root copied from another host: the task's setup
    is not run again, its tools, workdir and reward still apply).

    ``n``: trajectories made for this caller (every caller of the key gets its own).
    ``tools``: built-in tool names (default: the task's, else all of them).
    ``memory`` and ``pids`` size the root workspace of an ``image`` group (a task has its
    own). The first caller of a key builds the group; a later one must ask for the same
    root, tools and speculation, or gets ``state_conflict``.
    """

    key: str = Field(min_length=1, max_length=128, pattern=KEY_PATTERN)
    n: int = Field(default=1, ge=1, le=MAX_COUNT)
    image: ServedImage | None = None  # 'host' or an image reference
    snapshot: str | None = Field(default=None, min_length=1)
    task: dict[str, Any] | None = None
    tools: list[str] | None = Field(default=None, min_length=1)
    speculation: bool = True
    memory: str | int | None = "2G"
    pids: int | None = Field(default=512, ge=MIN_PIDS, le=PID_MAX_LIMIT)

    @model_validator(mode="after")
    def _one_root(self) -> CreateGroup:
        given = [f for f in ("image", "snapshot", "task") if getattr(self, f) is not None]
        if len(given) != 1 and given != ["snapshot", "task"]:
            raise ValueError("give one of image, snapshot or task, or a snapshot with its task (got "
                             f"{', '.join(given) or 'none'})")
        return self

    def source(self) -> dict[str, Any]:
        """What must be equal for two callers to share the group (all but ``n``)."""
        return self.model_dump(mode="json", exclude={"n"})


class TrajectoryOut(Model):
    """``workspace``: the id of the workspace it holds now (``None`` while it is served
    from the cache alone)."""

    id: str
    key: str
    workspace: str | None = None
    calls: int = 0
    hits: int = 0
    misses: int = 0
    closed: bool = False


class GroupOut(Model):
    """``created``: this call built the root. ``trajectories``: the ones this call made
    (``GET /v1/groups/{key}``: every open one). ``speculation``: the cache runs likely
    next calls ahead of time."""

    key: str
    root: str
    task: str | None = None
    tools: list[str]
    speculation: bool
    created: bool = False
    trajectories: list[TrajectoryOut]


class CallRequest(Model):
    """One tool call; ``arguments`` may be the model's JSON text, checked by the tool set."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class ObservationOut(Model):
    """``bunshin.tools.Observation`` on the wire (``cached``: served from the prefix cache;
    ``speculated``: computed ahead of time; ``images``: base64 PNGs, e.g. a screenshot)."""

    output: str
    exit_code: int | None = None
    error: str | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    cached: bool = False
    speculated: bool = False
    images: tuple[str, ...] = ()


class RewardOut(Model):
    """The task's reward command run in the trajectory's final workspace.

    ``reward``: the last number of its stdout (``None``: no reward command, or ``error``
    says why there is no number).
    """

    reward: float | None
    error: str | None = None
    exit_code: int | None = None
    output: str = ""
    duration_s: float = 0.0
    status: Literal["ok", "none", "error"] = "ok"
