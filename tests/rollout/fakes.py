"""Fakes for rollout unit tests: a tool set, workspaces and a task env without any container."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from bunshin.errors import AgentError
from bunshin.rollout.envs import TaskEnv
from bunshin.rollout.records import StepObservation
from bunshin.rollout.task import TaskSpec
from bunshin.runtime.agent_types import ExecResult


@dataclass
class FakeWorkspace:
    """A dict of 'files'; ``exec`` understands the reward command ``score``."""

    id: str
    files: dict[str, str] = field(default_factory=dict)
    alive: bool = True
    removed: bool = False

    async def exec(self, command: str, *, timeout: float | None = None) -> ExecResult:
        if not self.alive:
            raise AgentError(f"workspace {self.id} is not running")
        out = self.files.get("/score", "0") + "\n" if command == "score" else f"ran {command}\n"
        return ExecResult(0, None, out, "", False, False, False, 0.001)


class FakeTools:
    """``echo`` returns its text; ``write`` sets a file; ``sleep`` waits; ``crash`` kills the workspace."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
                for n in ("echo", "write", "sleep", "crash")]

    async def run(self, ws: FakeWorkspace, name: str, args: dict[str, Any]) -> StepObservation:
        self.calls.append((ws.id, name, args))
        if not ws.alive:
            raise AgentError(f"workspace {ws.id} is not running")
        if name == "echo":
            return StepObservation(output=str(args.get("text", "")), exit_code=0)
        if name == "write":
            ws.files[args["path"]] = args["content"]
            return StepObservation(output="ok", exit_code=0)
        if name == "sleep":
            await asyncio.sleep(float(args["s"]))
            return StepObservation(output="slept", exit_code=0)
        if name == "crash":
            ws.alive = False
            raise AgentError(f"workspace {ws.id}: agent vanished")
        return StepObservation(output="", exit_code=None, error=f"no tool {name}")


class FakeTrajectory:
    def __init__(self, env: FakeEnv, ws: FakeWorkspace) -> None:
        self.env, self.ws = env, ws

    async def call(self, name: str, args: dict[str, Any]) -> Any:
        return await self.env.tools.run(self.ws, name, args)

    async def workspace(self) -> FakeWorkspace:
        return self.ws

    async def close(self) -> None:
        self.ws.removed = True
        self.env.in_flight -= 1
        self.env.closed.append(self.ws.id)


class FakeEnv(TaskEnv):
    """Counts what it opens and closes; ``fail_prepare`` / ``fail_open`` inject failures."""

    def __init__(self, task: TaskSpec, tools: FakeTools, *, fail_prepare: bool = False,
                 fail_open: set[int] | None = None, open_delay: float = 0.0) -> None:
        super().__init__(task, tools, config=None)  # type: ignore[arg-type]
        self.fail_prepare, self.fail_open, self.open_delay = fail_prepare, fail_open or set(), open_delay
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.prepared = 0
        self.released = False
        self.options = {"fork": True, "cache": False, "speculation": False}
        self.in_flight = 0
        self.max_in_flight = 0

    async def prepare(self) -> None:
        self.prepared += 1
        if self.fail_prepare:
            raise RuntimeError("setup exploded")

    async def open(self, index: int) -> FakeTrajectory:
        await asyncio.sleep(self.open_delay)
        if index in self.fail_open:
            raise AgentError(f"could not start workspace {index}")
        ws = FakeWorkspace(f"ws{index}-{len(self.opened)}")
        self.opened.append(ws.id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return FakeTrajectory(self, ws)

    async def aclose(self) -> None:
        self.released = True
