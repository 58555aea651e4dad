"""Policies: what decides the next tool calls of a trajectory.

- :class:`TraceReplayPolicy` replays recorded traces (JSONL), waiting each step's
  recorded think time for real, so speculation can use it.
- :class:`CallablePolicy` wraps a Python function (sync or async).
- :class:`~bunshin.rollout.openai_client.OpenAIPolicy` asks an OpenAI-compatible
  chat-completions endpoint (vLLM, SGLang).

Trace JSONL: one trace per line::

    {"id": "t0", "task": "fix-parser", "steps": [
        {"think_s": 1.5, "name": "bash", "arguments": {"command": "ls"}}, ...],
     "final": {"think_s": 0.5, "content": "done"}}

or one step per line, grouped by ``"trace"`` in file order. A step's call may also
sit under ``"tool_call"`` (so a rollout's own output rows replay as traces).
Trajectory ``i`` of a group replays the ``i``-th trace of its task, round robin.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import InvalidArgument
from ..tools.spec import Step, ToolCall
from ..workspace.aio import default_bridge
from .records import Action
from .task import TaskSpec


@dataclass
class PolicyContext:
    """What a policy sees when it decides a turn; ``messages`` is the chat so far."""

    task: TaskSpec
    index: int  # the trajectory's position in its group
    turn: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    trajectory_id: str = ""
    state: dict[str, Any] = field(default_factory=dict)  # free for the policy's own per-trajectory use


@runtime_checkable
class Policy(Protocol):
    """Decides each turn. ``name`` shows up in the output rows."""

    name: str

    async def act(self, ctx: PolicyContext) -> Action: ...


# --- trace replay --------------------------------------------------------------------------

#: Longest think time a trace step may record (s).
MAX_THINK_S = 24 * 3600.0


@dataclass(frozen=True)
class Trace:
    """A recorded trajectory: its steps (calls, each with the think time before it) in order."""

    id: str
    steps: tuple[Step, ...]
    task: str | None = None
    final_content: str = ""
    final_think_s: float = 0.0


def _step(obj: Any, where: str, turn: int) -> Step:
    if not isinstance(obj, dict):
        raise InvalidArgument(f"{where}: a step must be an object, got {type(obj).__name__}",
                              hint='write each step as {"name": ..., "arguments": {...}}')
    call = obj.get("tool_call") or obj.get("call") or obj
    if not isinstance(call, dict):
        raise InvalidArgument(f"{where}: field 'tool_call' must be an object, got {type(call).__name__}",
                              hint='write it as {"name": ..., "arguments": {...}}')
    name, args = call.get("name"), call.get("arguments", {})
    if isinstance(args, str):  # the OpenAI wire form
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise InvalidArgument(f"{where}: 'arguments' is not JSON") from None
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}: field 'name' missing", hint="each step needs a tool name")
    if not isinstance(args, dict):
        raise InvalidArgument(f"{where}: field 'arguments' must be an object")
    think = obj.get("think_s", 0.0)
    if isinstance(think, bool) or not isinstance(think, int | float) or not 0 <= think <= MAX_THINK_S:
        raise InvalidArgument(f"{where}: field 'think_s' must be a number of seconds from 0 to {MAX_THINK_S:g}")
    return Step(turn, float(think), ToolCall(name, args))


def parse_traces(lines: Iterable[str], *, source: str = "traces") -> list[Trace]:
    """Traces from JSONL lines (whole traces, or step lines grouped by ``trace``)."""
    whole: list[Trace] = []
    grouped: dict[str, list[Step]] = {}
    tasks: dict[str, str | None] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{where}: not JSON ({e.msg})", hint="one JSON object per line") from None
        except RecursionError:
            raise InvalidArgument(f"{where}: JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise InvalidArgument(f"{where}: expected an object, got {type(obj).__name__}",
                                  hint="one trace or one step per line, each a JSON object")
        task = obj.get("task") or obj.get("task_id")
        if task is not None and not isinstance(task, str):
            raise InvalidArgument(f"{where}: field 'task' must be a string (a task id)")
        if "steps" in obj:
            if not isinstance(obj["steps"], list):
                raise InvalidArgument(f"{where}: field 'steps' must be a list")
            final = obj.get("final") or {}
            if not isinstance(final, dict):
                raise InvalidArgument(f"{where}: field 'final' must be an object",
                                      hint='e.g. {"think_s": 0.5, "content": "done"}')
            final_think = final.get("think_s") or 0.0
            if isinstance(final_think, bool) or not isinstance(final_think, int | float) \
                    or not 0 <= final_think <= MAX_THINK_S:
                raise InvalidArgument(f"{where}: field 'final.think_s' must be a number of seconds "
                                      f"from 0 to {MAX_THINK_S:g}")
            whole.append(Trace(
                id=str(obj.get("id") or obj.get("trajectory_id") or f"trace-{len(whole)}"),
                steps=tuple(_step(s, f"{where} step {i}", i + 1) for i, s in enumerate(obj["steps"])),
                task=task,
                final_content=str(final.get("content") or ""),
                final_think_s=float(final_think),
            ))
        else:
            key = str(obj.get("trace", "trace"))
            group = grouped.setdefault(key, [])
            group.append(_step(obj, where, len(group) + 1))
            tasks.setdefault(key, obj.get("task") or None)
    traces = whole + [Trace(k, tuple(v), tasks.get(k)) for k, v in grouped.items()]
    if not traces:
        raise InvalidArgument(f"{source}: no traces", hint="one JSON object per line")
    return traces


def load_traces(path: str | Path) -> list[Trace]:
    """Traces from a JSONL file; a bad line raises ``InvalidArgument`` naming the file and line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read traces {p}: {e.strerror}", hint="give a JSONL file of traces") from None
    lines = []
    for n, line in enumerate(raw.splitlines(), 1):
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"{p} line {n}: not UTF-8 text (byte {e.start + 1})",
                                  hint="a trace file is JSONL: one JSON object per line") from None
    return parse_traces(lines, source=str(p))


class TraceReplayPolicy:
    """Replays traces; sleeps each recorded think time (scaled by ``think_scale``)."""

    name = "trace-replay"

    def __init__(self, traces: Sequence[Trace], *, think_scale: float = 1.0) -> None:
        if not traces:
            raise InvalidArgument("no traces to replay")
        self.traces = list(traces)
        self.think_scale = think_scale

    @classmethod
    def from_file(cls, path: str | Path, **kw: Any) -> TraceReplayPolicy:
        return cls(load_traces(path), **kw)

    def trace_for(self, task_id: str, index: int) -> Trace:
        mine = [t for t in self.traces if t.task in (None, task_id)]
        if not mine:
            raise InvalidArgument(f"no trace for task {task_id!r}",
                                  hint="traces carry a 'task' field; it must match the task's id")
        return mine[index % len(mine)]

    async def act(self, ctx: PolicyContext) -> Action:
        trace = ctx.state.get("trace") or self.trace_for(ctx.task.id, ctx.index)
        ctx.state["trace"] = trace
        pos = ctx.state.get("pos", 0)
        if pos >= len(trace.steps):
            await asyncio.sleep(trace.final_think_s * self.think_scale)
            return Action(content=trace.final_content or None, think_s=trace.final_think_s * self.think_scale)
        step = trace.steps[pos]
        ctx.state["pos"] = pos + 1
        think = step.think_s * self.think_scale
        await asyncio.sleep(think)
        return Action(tool_calls=(ToolCall(step.name, dict(step.arguments), id=f"call-{pos}"),), think_s=think)


# --- a Python callable -----------------------------------------------------------------------

ActFn = Callable[[PolicyContext], "Action | Sequence[ToolCall | dict[str, Any]] | None | Awaitable[Any]"]


def as_action(value: Any) -> Action:
    """An :class:`Action` from what a callable returned: an Action, calls, dicts, or None (stop)."""
    if isinstance(value, Action):
        return value
    if value is None:
        return Action()
    if isinstance(value, str):
        return Action(content=value)
    if isinstance(value, ToolCall | dict):
        value = [value]
    calls = []
    for c in value:
        if isinstance(c, ToolCall):
            calls.append(c)
        elif isinstance(c, dict) and isinstance(c.get("name"), str):
            calls.append(ToolCall(c["name"], dict(c.get("arguments") or {})))
        else:
            raise InvalidArgument(f"policy returned {c!r}", hint="return an Action, ToolCalls, dicts with 'name', or None")
    return Action(tool_calls=tuple(calls))


class CallablePolicy:
    """A policy from a function ``fn(ctx) -> Action | [ToolCall | {'name','arguments'}] | None``.

    The function may be async; a sync one runs in a worker thread.
    """

    def __init__(self, fn: ActFn, *, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "callable")

    async def act(self, ctx: PolicyContext) -> Action:
        if inspect.iscoroutinefunction(self.fn):
            value = await self.fn(ctx)
        else:
            value = await default_bridge().run_sync(self.fn, ctx)
            if inspect.isawaitable(value):
                value = await value
        return as_action(value)
