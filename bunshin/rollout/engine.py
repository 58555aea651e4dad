"""The rollout engine: groups of N trajectories per task, each in its own workspace, with rewards.

::

    async with RolloutEngine("bunshin") as engine:
        group = await engine.run_group(task, policy, n=8)
        rows = [t.to_row() for t in group.trajectories]

A trajectory that crashes, times out or fails setup is reported with its
:class:`~bunshin.rollout.records.Status` and error; its group still finishes. The task
root (setup run once, snapshotted) is kept per task for the engine's lifetime, so
later groups of the same task (later training iterations) start from it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config import Config
from ..errors import BunshinError, InvalidArgument
from ..workspace import LocalHost
from ..workspace.aio import default_bridge
from ..workspace.protocol import HostAPI
from .envs import (
    EnvPlacement,
    Mode,
    ModeOptions,
    TaskEnv,
    ToolRunner,
    TrajectoryEnv,
    make_env,
    with_task_tools,
)
from .policies import Policy, PolicyContext
from .records import (
    Action,
    GroupResult,
    Observation,
    Status,
    Step,
    Timings,
    ToolCall,
    TrajectoryResult,
    new_id,
)
from .task import TaskSpec, parse_reward, resolve_image

log = logging.getLogger(__name__)
EventFn = Callable[[str, dict[str, Any]], None]
THREADS = 64


def default_tools() -> ToolRunner:
    """``bunshin.tools.ToolSet.default()``: bash session, files, edit, python."""
    from ..tools import ToolSet  # imported when first needed, as rollout.envs does

    return ToolSet.default()


def tool_schemas(tools: ToolRunner, task: TaskSpec) -> list[dict[str, Any]]:
    """The task's tools in the OpenAI ``tools`` form; a tool the set lacks is an error."""
    schemas = tools.openai_tools()
    if task.tools is None or not schemas:
        return schemas
    by_name = {s.get("function", {}).get("name"): s for s in schemas}
    missing = [t for t in task.tools if t not in by_name]
    if missing:
        raise InvalidArgument(f"task {task.id}: field 'tools': unknown tool {missing[0]!r}",
                              hint=f"the tool set has: {', '.join(sorted(n for n in by_name if n))}")
    return [by_name[t] for t in task.tools]


class Episode:
    """One trajectory, step by step: open a workspace, apply actions, score, close."""

    def __init__(self, env: TaskEnv, *, index: int, run_id: str, group_id: str, mode: str,
                 schemas: list[dict[str, Any]], policy_name: str = "") -> None:
        self.env, self.task, self.index = env, env.task, index
        self.run_id, self.group_id, self.mode = run_id, group_id, mode
        self.trajectory_id = f"{group_id}-{index}"
        self.schemas = schemas
        self.policy_name = policy_name
        self.allowed = set(self.task.tools) if self.task.tools is not None else None
        self.messages: list[dict[str, Any]] = self.task.initial_messages()
        self.steps: list[Step] = []
        self.turn = 0
        self.policy_state: dict[str, Any] = {}
        self.traj: TrajectoryEnv | None = None
        self.started = time.time()
        self._t0 = time.perf_counter()
        self.queued_s = self.env_s = self.think_s = self.tools_s = 0.0
        self.result: TrajectoryResult | None = None

    def context(self) -> PolicyContext:
        return PolicyContext(task=self.task, index=self.index, turn=self.turn, messages=list(self.messages),
                             tools=self.schemas, trajectory_id=self.trajectory_id, state=self.policy_state)

    async def open(self) -> None:
        t0 = time.perf_counter()
        self.traj = await self.env.open(self.index)
        self.env_s = time.perf_counter() - t0

    async def apply(self, action: Action, think_s: float) -> list[Step]:
        """Run the action's tool calls in order; their results join the chat."""
        assert self.traj is not None, "open() first"
        self.turn += 1
        self.think_s += think_s
        self.messages.append(action.assistant_message())
        new: list[Step] = []
        for i, call in enumerate(action.tool_calls):
            t0 = time.perf_counter()
            if self.allowed is not None and call.name not in self.allowed:
                obs = Observation(output="", error=f"unknown tool {call.name!r}; tools: {sorted(self.allowed)}")
            else:
                obs = await self.traj.call(call.name, call.arguments)
            latency = time.perf_counter() - t0
            self.tools_s += latency
            step = Step(self.turn, think_s if i == 0 else 0.0, call, obs, latency)
            self.steps.append(step)
            new.append(step)
            self.messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": obs.content()})
        return new

    def final(self, action: Action, think_s: float) -> None:
        self.think_s += think_s
        if action.content is not None or action.message is not None:
            self.messages.append(action.assistant_message())

    async def reward(self) -> float | None:
        """Run the task's reward command in the final workspace (``None`` if the task has none)."""
        if self.task.reward is None:
            return None
        assert self.traj is not None
        ws = await self.traj.workspace()
        spec = self.task.reward
        r = await ws.exec(spec.command, timeout=spec.timeout)
        if r.timed_out:
            raise BunshinError(f"reward command timed out after {spec.timeout:g}s")
        try:
            return parse_reward(_text(r.stdout))
        except ValueError as e:
            raise BunshinError(f"reward command exited {r.exit_code}: {e}",
                               hint=_text(r.stderr)[-300:] or None) from None

    async def finish(self, status: Status, error: str | None = None) -> TrajectoryResult:
        """Score (if it ended well), close the workspace, and build the result."""
        reward, reward_s = None, 0.0
        if status in (Status.COMPLETED, Status.MAX_TURNS) and self.traj is not None:
            t0 = time.perf_counter()
            try:
                reward = await self.reward()
            except Exception as e:
                status, error = Status.ERROR, f"reward: {e}"
            reward_s = time.perf_counter() - t0
        placement = dict(getattr(self.traj, "placement", None) or {})  # set by envs that place (cluster)
        await self.close()
        self.result = TrajectoryResult(
            run_id=self.run_id, task_id=self.task.id, group_id=self.group_id, trajectory_id=self.trajectory_id,
            index=self.index, mode=self.mode, options=dict(self.env.options), status=status, reward=reward,
            messages=self.messages, steps=self.steps, error=error, policy=self.policy_name, placement=placement,
            timings=Timings(queued_s=round(self.queued_s, 4), env_s=round(self.env_s, 4),
                            think_s=round(self.think_s, 4), tools_s=round(self.tools_s, 4),
                            reward_s=round(reward_s, 4), total_s=round(time.perf_counter() - self._t0, 4),
                            started_at=self.started),
        )
        return self.result

    async def close(self) -> None:
        if self.traj is not None:
            traj, self.traj = self.traj, None
            try:
                await asyncio.shield(traj.close())
            except Exception as e:
                log.warning("closing trajectory %s failed: %s", self.trajectory_id, e)


def _text(stream: str | bytes) -> str:
    """A text-mode exec stream (``bytes`` only come from ``text=False``)."""
    return stream if isinstance(stream, str) else stream.decode("utf-8", "replace")


def describe(e: BaseException) -> str:
    return str(e) if isinstance(e, BunshinError) else f"{type(e).__name__}: {e}"


class RolloutEngine:
    """Runs groups of trajectories in one mode; an async context manager owning the task roots."""

    def __init__(self, mode: Mode | str = Mode.BUNSHIN, *, tools: ToolRunner | None = None,
                 options: ModeOptions | None = None, concurrency: int | None = None,
                 config: Config | None = None, on_event: EventFn | None = None,
                 env_factory: Callable[[TaskSpec], TaskEnv] | None = None,
                 host: HostAPI | None = None, cluster: EnvPlacement | None = None) -> None:
        """``host``: where workspaces are made: this machine under ``config`` (the default) or
        a ``bunshin serve`` host (a :class:`bunshin.client.Client`). ``cluster``: the
        trajectories placed over several hosts instead (:class:`bunshin.cluster.ClusterPlacement`).
        ``env_factory`` replaces the mode's :class:`TaskEnv` (tests, other backends)."""
        if host is not None and cluster is not None:
            raise InvalidArgument("give host or cluster, not both", hint="a cluster places workspaces itself")
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise InvalidArgument(f"unknown mode {mode!r}", hint="one of: baseline, copy, bunshin") from None
        self.options = options or ModeOptions()
        self._tools = tools
        self.concurrency = concurrency
        self.config = config or Config.from_env()
        self.on_event = on_event
        self.run_id = new_id("run")
        self._env_factory = env_factory
        self.host = host
        self.cluster = cluster
        self._sem = asyncio.Semaphore(concurrency) if concurrency else None
        self._envs: dict[str, TaskEnv] = {}
        self._given: dict[str, TaskSpec] = {}  # each task as the caller gave it (its env's has the digest)
        self._retired: list[TaskEnv] = []  # roots of an image tag that moved since: freed at close
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def tools(self) -> ToolRunner:
        if self._tools is None:
            self._tools = default_tools()
        return self._tools

    async def __aenter__(self) -> RolloutEngine:
        # Blocking work (workspace calls, callable policies) runs in the one thread bridge:
        # wide enough that a group's calls never queue behind each other on a small machine.
        default_bridge().resize(max(THREADS, 2 * (self.concurrency or 0)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        envs, self._envs = list(self._envs.values()) + self._retired, {}
        self._retired = []
        for env in envs:
            await env.aclose()

    def cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters per task id (tasks whose env has none are left out)."""
        return {tid: st for tid, env in self._envs.items() if (st := env.stats())}

    def options_in_effect(self) -> dict[str, bool]:
        """The ablation switches as applied (e.g. the cache off when ``bunshin.cache`` is missing)."""
        for env in self._envs.values():
            return dict(env.options)
        return self.options.effective(self.mode)

    def _emit(self, kind: str, **info: Any) -> None:
        if self.on_event is not None:
            try:
                self.on_event(kind, info)
            except Exception as e:  # a broken progress display must not break the rollout
                log.warning("event handler failed: %s", e)

    async def env(self, task: TaskSpec) -> TaskEnv:
        """The prepared :class:`TaskEnv` of ``task`` (its root is built on first use)."""
        lock = self._locks.setdefault(task.id, asyncio.Lock())
        async with lock:
            env = self._envs.get(task.id)
            if env is not None and self._given[task.id] != task:
                raise InvalidArgument(f"two different tasks share the id {task.id!r}")
            given, task = task, await self._pinned(task)
            if env is not None and env.task.image != task.image:  # the image's tag names another digest now
                self._retired.append(self._envs.pop(task.id))
                env = None
            if env is None:
                if self._env_factory is not None:
                    env = self._env_factory(task)
                elif self.cluster is not None:
                    env = self.cluster.make_env(self.mode, task, self.tools, self.config, self.options)
                else:
                    env = make_env(self.mode, task, self.tools, self.config, self.options, host=self.host)
                self._emit("prepare_start", task=task.id)
                await env.prepare()
                self._envs[task.id] = env
                self._given[task.id] = given
                self._emit("prepare_end", task=task.id, seconds=env.prepare_s)
            return env

    async def _pinned(self, task: TaskSpec) -> TaskSpec:
        """``task`` with its image named by digest (pulled first if need be) when its workspaces
        are made here: the root is built from, and keyed by, what the tag names now (a new
        digest builds a new root), and every trajectory runs on that one image. On a served
        host or a cluster the host resolves it."""
        if task.image == "host" or self._env_factory is not None or self.cluster is not None or \
                not isinstance(self.host or LocalHost(self.config), LocalHost):
            return task
        config = self.config
        image = await default_bridge().run_sync(lambda: resolve_image(task, config))
        return task if image == task.image else task.model_copy(update={"image": image})

    def episode(self, env: TaskEnv, index: int, group_id: str, policy_name: str = "") -> Episode:
        return Episode(env, index=index, run_id=self.run_id, group_id=group_id, mode=self.mode.value,
                       schemas=tool_schemas(env.tools, env.task), policy_name=policy_name)

    async def run_group(self, task: TaskSpec, policy: Policy, n: int, *, group_id: str | None = None) -> GroupResult:
        """``n`` trajectories of ``task``, concurrently (within the engine's concurrency limit)."""
        if n < 1:
            raise InvalidArgument(f"group size {n}", hint="give --group N with N >= 1")
        gid = group_id or new_id(f"{task.id}-g")
        tool_schemas(with_task_tools(self.tools, task), task)  # a bad tool list fails the call, not each trajectory
        t0 = time.perf_counter()
        self._emit("group_start", task=task.id, group_id=gid, n=n)
        try:
            env = await self.env(task)
        except Exception as e:
            err = f"task root: {describe(e)}"
            results = [self._failed(task, gid, i, err, policy) for i in range(n)]
            for r in results:
                self._emit("trajectory_end", result=r)
            return GroupResult(self.run_id, task.id, gid, self.mode.value, results, time.perf_counter() - t0, 0.0)
        env.new_group()
        results = await asyncio.gather(*(self.run_trajectory(env, policy, i, gid) for i in range(n)))
        group = GroupResult(self.run_id, task.id, gid, self.mode.value, list(results),
                            makespan_s=time.perf_counter() - t0, prepare_s=env.prepare_s)
        self._emit("group_end", group=group)
        return group

    async def run(self, tasks: Sequence[TaskSpec], policy: Policy, n: int) -> list[GroupResult]:
        """One group per task, all at once."""
        return list(await asyncio.gather(*(self.run_group(t, policy, n) for t in tasks)))

    async def run_trajectory(self, env: TaskEnv, policy: Policy, index: int, group_id: str) -> TrajectoryResult:
        t_queue = time.perf_counter()
        if self._sem is not None:
            await self._sem.acquire()
        try:
            ep = self.episode(env, index, group_id, getattr(policy, "name", ""))
            ep.queued_s = time.perf_counter() - t_queue
            self._emit("trajectory_start", task=env.task.id, trajectory_id=ep.trajectory_id)
            status, error = Status.COMPLETED, None
            try:
                async with asyncio.timeout(env.task.trajectory_timeout) as cm:
                    status = await self._drive(ep, policy)
            except TimeoutError as e:
                if cm.expired():
                    status, error = Status.TIMEOUT, f"trajectory ran past {env.task.trajectory_timeout:g}s"
                else:
                    status, error = Status.ERROR, describe(e)
            except Exception as e:
                status, error = Status.ERROR, describe(e)
            except asyncio.CancelledError:
                await asyncio.shield(ep.close())
                raise
            result = await ep.finish(status, error)
            self._emit("trajectory_end", result=result)
            return result
        finally:
            if self._sem is not None:
                self._sem.release()

    async def _drive(self, ep: Episode, policy: Policy) -> Status:
        await ep.open()
        while True:
            if ep.turn >= ep.task.max_turns:
                return Status.MAX_TURNS
            t0 = time.perf_counter()
            action = await policy.act(ep.context())
            think = time.perf_counter() - t0
            if action.final:
                ep.final(action, think)
                return Status.COMPLETED
            await ep.apply(action, think)

    def _failed(self, task: TaskSpec, gid: str, index: int, error: str, policy: Policy) -> TrajectoryResult:
        return TrajectoryResult(
            run_id=self.run_id, task_id=task.id, group_id=gid, trajectory_id=f"{gid}-{index}", index=index,
            mode=self.mode.value, options=self.options.effective(self.mode), status=Status.ERROR, reward=None,
            messages=task.initial_messages(), steps=[], timings=Timings(started_at=time.time()), error=error,
            policy=getattr(policy, "name", ""))


async def rollout(task: TaskSpec, policy: Policy, n: int, *, mode: Mode | str = Mode.BUNSHIN,
                  options: ModeOptions | None = None, tools: ToolRunner | None = None,
                  concurrency: int | None = None, config: Config | None = None,
                  on_event: EventFn | None = None, host: HostAPI | None = None) -> GroupResult:
    """One group of ``n`` trajectories of ``task`` (its workspaces on ``host``, default this
    machine); the task root is freed afterwards."""
    async with RolloutEngine(mode, tools=tools, options=options, concurrency=concurrency, config=config,
                             on_event=on_event, host=host) as engine:
        return await engine.run_group(task, policy, n)


def rollout_sync(*args: Any, **kw: Any) -> GroupResult:
    """:func:`rollout` for code without an event loop."""
    return asyncio.run(rollout(*args, **kw))


__all__ = ["Action", "Episode", "RolloutEngine", "ToolCall", "rollout", "rollout_sync"]
