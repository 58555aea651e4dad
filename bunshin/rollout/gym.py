"""A Gymnasium-style environment: one object per trajectory, ``reset(task)`` / ``step(action)``.

::

    env = RolloutEnv("bunshin")
    obs, info = env.reset(task)                 # obs: {"messages", "tools", "turn"}
    obs, reward, terminated, truncated, info = env.step({"name": "bash", "arguments": {"command": "ls"}})
    ...
    obs, reward, terminated, truncated, info = env.step("done")   # no tool calls: the episode ends
    env.close()

An action is anything a :class:`~bunshin.rollout.policies.CallablePolicy` may return:
an :class:`~bunshin.rollout.records.Action`, a tool call or a list of them (``ToolCall``
or ``{"name", "arguments"}``), a string or ``None`` (final answer, no calls). The reward
(0.0 until the episode ends) comes from the task's reward command in the final
workspace. Several envs may share one :class:`~bunshin.rollout.engine.RolloutEngine`
(``engine=``), and so one task root; the ``a``-prefixed methods are the async API.
Per-call timeouts apply; the task's ``trajectory_timeout`` does not (the trainer sets
the pace between steps).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..config import Config
from ..errors import StateConflict
from .engine import Episode, RolloutEngine, describe
from .envs import Mode, ModeOptions, ToolRunner
from .policies import as_action
from .records import Status, TrajectoryResult, new_id
from .task import TaskSpec


class RolloutEnv:
    """One trajectory at a time, driven from outside (by a trainer)."""

    def __init__(self, mode: Mode | str = Mode.BUNSHIN, *, engine: RolloutEngine | None = None,
                 tools: ToolRunner | None = None, options: ModeOptions | None = None,
                 config: Config | None = None) -> None:
        self._own_engine = engine is None
        self.engine = engine or RolloutEngine(mode, tools=tools, options=options, config=config)
        self._episode: Episode | None = None
        self._runner: asyncio.Runner | None = None
        self.last_result: TrajectoryResult | None = None

    # async API ---------------------------------------------------------------------------

    async def areset(self, task: TaskSpec, *, group_id: str | None = None,
                     index: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
        """End any running episode, then open a workspace for a new trajectory of ``task``."""
        await self._end(Status.ERROR, "reset before the episode ended")
        await self.engine.__aenter__()
        env = await self.engine.env(task)
        ep = self.engine.episode(env, index, group_id or new_id(f"{task.id}-gym"))
        await ep.open()
        self._episode = ep
        return self._obs(), {"trajectory_id": ep.trajectory_id, "env_s": ep.env_s}

    async def astep(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        ep = self._episode
        if ep is None:
            raise StateConflict("step() without a running episode", hint="call reset(task) first")
        act = as_action(action)
        info: dict[str, Any] = {"trajectory_id": ep.trajectory_id}
        if act.final:
            ep.final(act, act.think_s)
            return self._done(await self._end(Status.COMPLETED), truncated=False, info=info)
        try:
            steps = await ep.apply(act, act.think_s)
        except Exception as e:
            return self._done(await self._end(Status.ERROR, describe(e)), truncated=False, info=info)
        info["steps"] = steps
        if ep.turn >= ep.task.max_turns:
            return self._done(await self._end(Status.MAX_TURNS), truncated=True, info=info)
        return self._obs(), 0.0, False, False, info

    async def aclose(self) -> None:
        await self._end(Status.ERROR, "closed before the episode ended")
        if self._own_engine:
            await self.engine.aclose()

    # sync API ----------------------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(coro)

    def reset(self, task: TaskSpec, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._run(self.areset(task, **kw))

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        return self._run(self.astep(action))

    def close(self) -> None:
        try:
            self._run(self.aclose())
        finally:
            if self._runner is not None:
                self._runner.close()
                self._runner = None

    def __enter__(self) -> RolloutEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # helpers -----------------------------------------------------------------------------

    def _obs(self) -> dict[str, Any]:
        ep = self._episode
        assert ep is not None
        return {"messages": list(ep.messages), "tools": ep.schemas, "turn": ep.turn}

    async def _end(self, status: Status, error: str | None = None) -> TrajectoryResult | None:
        ep, self._episode = self._episode, None
        if ep is None:
            return None
        self.last_result = await ep.finish(status, error)
        return self.last_result

    def _done(self, result: TrajectoryResult | None, *, truncated: bool,
              info: dict[str, Any]) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        assert result is not None
        info.update(status=result.status.value, error=result.error, result=result)
        obs = {"messages": list(result.messages), "tools": [], "turn": len({s.turn for s in result.steps})}
        return obs, float(result.reward or 0.0), not truncated, truncated, info
