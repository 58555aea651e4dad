"""Tool records: what a tool is (``ToolSpec``), a call of it (``ToolCall``), what the call
returns (``Observation``) and one step of a trajectory (``Step``).

These are the one vocabulary of the layers above: the prefix cache keys its tree by
``ToolCall.key``, speculation predicts ``ToolCall``s, and a rollout records ``Step``s
and shows the model ``Observation.text()``.

A tool is a spec (name, JSON schema of its arguments, flags) plus a blocking
executor that runs inside a workspace. Executors return a ``ToolOutput`` or
raise ``ToolError``; ``ToolSet`` times them and wraps the result into an
``Observation``. A call's cache key is the canonical JSON of its name and its
arguments (schema defaults filled in, integral floats as integers).
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InvalidArgument
from ..errors import ToolError as ToolError  # part of the tools API; defined in the one error tree
from ..runtime.kernel.limits import check_timeout
from ..workspace.protocol import WorkspaceAPI


@dataclass(frozen=True)
class ToolSpec:
    """A tool as the model sees it, plus what the cache needs to know.

    ``deterministic``: the same call from the same state gives the same result and
    state (so it may be cached). ``read_only``: the call leaves the workspace
    state unchanged. ``timeout``: seconds before the call is interrupted.
    """

    name: str
    description: str
    parameters: Mapping[str, Any] = field(hash=False)
    deterministic: bool = True
    read_only: bool = False
    timeout: float = 120.0

    def __post_init__(self) -> None:
        check_timeout(self.timeout, f"the timeout of tool {self.name!r}")

    def openai(self) -> dict[str, Any]:
        """This tool in the OpenAI function-calling format."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": json.loads(json.dumps(self.parameters)),
            },
        }


def _call_id() -> str:
    return f"call-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool: asked for by a policy, keyed by the cache, recorded in a trace.

    ``id`` ties it to its tool message in a chat (it takes no part in equality: the
    same tool with the same arguments is the same call). ``key`` is its canonical form
    (``call_key``) once its arguments are checked and their defaults filled in
    (``ToolSet.check``, ``ToolSet.key``); empty on a call nobody checked yet.
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=_call_id, compare=False)
    key: str = ""

    def openai(self) -> dict[str, Any]:
        """The call in the OpenAI chat format (an assistant message's ``tool_calls`` item)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass(frozen=True)
class Observation:
    """The result of one tool call, as the model will see it (``text()``).

    ``error`` is a tool-level failure (bad arguments, file not found, edit text
    not unique...); ``exit_code`` is ``None`` when there is no exit status (an
    error, or an interrupted command). ``cached``: served from the prefix cache;
    ``speculated``: computed ahead of time by a speculation. ``images``: base64 PNGs
    (a screenshot), shown to the model as image parts (``content()``).
    """

    output: str
    exit_code: int | None = None
    error: str | None = None
    timed_out: bool = False
    duration_s: float = 0.0
    cached: bool = False
    speculated: bool = False
    images: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0

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

    def content(self) -> str | list[dict[str, Any]]:
        """The tool message's ``content`` in OpenAI's chat format: the text, or (with
        images) a text part and one ``image_url`` part (a PNG data URL) per image."""
        if not self.images:
            return self.text()
        text = self.text()
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}} for b64 in self.images]
        return parts

    def same_result(self, other: Observation) -> bool:
        """True when both calls produced the same result (timing and provenance aside)."""
        return (self.output, self.exit_code, self.error, self.timed_out, self.images) == (
            other.output, other.exit_code, other.error, other.timed_out, other.images,
        )

    def as_cached(self, *, duration_s: float, speculated: bool = False) -> Observation:
        return replace(self, cached=True, speculated=speculated, duration_s=duration_s)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"output": self.output, "exit_code": self.exit_code, "error": self.error,
             "timed_out": self.timed_out, "duration_s": self.duration_s}
        if self.images:
            d["images"] = list(self.images)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Observation:
        return cls(output=d["output"], exit_code=d.get("exit_code"), error=d.get("error"),
                   timed_out=bool(d.get("timed_out")), duration_s=float(d.get("duration_s", 0.0)),
                   images=tuple(str(b) for b in d.get("images") or ()))


@dataclass(frozen=True)
class Step:
    """One tool call of a trajectory: its turn (from 1), the policy's think time before
    it, the call, what came back and how long that took. A recorded trace's steps (calls
    to replay) have no observation."""

    turn: int
    think_s: float
    tool_call: ToolCall
    observation: Observation | None = None
    latency_s: float = 0.0

    @property
    def name(self) -> str:
        return self.tool_call.name

    @property
    def arguments(self) -> dict[str, Any]:
        return self.tool_call.arguments


@dataclass(frozen=True)
class ToolOutput:
    """What an executor returns; ``ToolSet`` adds the timing. ``images``: base64 PNGs."""

    output: str
    exit_code: int | None = 0
    timed_out: bool = False
    images: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolContext:
    """What an executor may need besides its arguments."""

    workdir: str
    timeout: float


#: ``execute(workspace, arguments, context)``; blocking, runs in a bridge thread.
Executor = Callable[[WorkspaceAPI, Mapping[str, Any], ToolContext], ToolOutput]


@dataclass(frozen=True)
class Tool:
    """A spec and the executor that runs it inside a workspace."""

    spec: ToolSpec
    execute: Executor = field(hash=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name


def canonical(value: Any) -> Any:
    """JSON-ready form with integral floats as ints (``1.0`` and ``1`` are one key)."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"arguments must be finite numbers, not {value!r}")
        return int(value) if value.is_integer() and abs(value) < 2**53 else value
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    raise InvalidArgument(f"arguments must be JSON values, not {type(value).__name__}")


def call_key(name: str, args: Mapping[str, Any]) -> str:
    """The canonical form of a call: equal for calls that mean the same thing."""
    return json.dumps([name, canonical(args)], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)
