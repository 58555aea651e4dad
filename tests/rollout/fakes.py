"""Fakes for rollout unit tests: a tool set and a task env over ``bunshin.testing``'s workspaces."""

from __future__ import annotations

import asyncio
from typing import Any

from bunshin import AsyncWorkspace
from bunshin.errors import AgentError
from bunshin.rollout.envs import TaskEnv
from bunshin.rollout.records import StepObservation
from bunshin.rollout.task import TaskSpec
from bunshin.testing import FakeWorkspace, FakeWorld


def _score(ws: FakeWorkspace, args: list[str]) -> tuple[str, int]:
    """The reward command ``score``: the number in /score (0 without one)."""
    return ws.state.files.get("/score", b"0").decode() + "\n", 0


WORLD = FakeWorld(commands={"score": _score})


class FakeTools:
    """``echo`` returns its text; ``write`` sets a file; ``sleep`` waits; ``crash`` kills the workspace."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": n, "description": n, "parameters": {"type": "object"}}}
                for n in ("echo", "write", "sleep", "crash")]

    async def run(self, ws: AsyncWorkspace, name: str, args: dict[str, Any]) -> StepObservation:
        self.calls.append((ws.id, name, args))
        fake = ws.sync
        assert isinstance(fake, FakeWorkspace)
        if not fake.alive:
            raise AgentError(f"workspace {ws.id} is not running")
        if name == "echo":
            return StepObservation(output=str(args.get("text", "")), exit_code=0)
        if name == "write":
            await ws.files.write(args["path"], args["content"])
            return StepObservation(output="ok", exit_code=0)
        if name == "sleep":
            await asyncio.sleep(float(args["s"]))
            return StepObservation(output="slept", exit_code=0)
        if name == "crash":
            fake.alive = False
            raise AgentError(f"workspace {ws.id}: agent vanished")
        return StepObservation(output="", exit_code=None, error=f"no tool {name}")


class FakeTrajectory:
    def __init__(self, env: FakeEnv, ws: AsyncWorkspace) -> None:
        self.env, self.ws = env, ws

    async def call(self, name: str, args: dict[str, Any]) -> Any:
        return await self.env.tools.run(self.ws, name, args)

    async def workspace(self) -> AsyncWorkspace:
        return self.ws

    async def close(self) -> None:
        self.env.in_flight -= 1
        self.env.closed.append(self.ws.id)  # the engine closed it; the removal may outlive a cancel
        await asyncio.shield(self.ws.remove())


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
        ws = AsyncWorkspace(WORLD.create())
        self.opened.append(ws.id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return FakeTrajectory(self, ws)

    async def aclose(self) -> None:
        self.released = True
