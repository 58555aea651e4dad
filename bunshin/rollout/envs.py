"""Where trajectories run, per mode: how a trajectory gets its workspace and runs its calls.

- ``baseline``: a fresh workspace per trajectory, the task's setup re-run in each;
  no cache, no speculation (one isolated environment per trajectory, as done today).
- ``copy``: the task's setup runs once, the workspace is snapshotted with plain CRIU
  (private pages) and each trajectory restores its own copy.
- ``bunshin``: setup once, a copy-on-write snapshot as the task root; trajectories
  go through the tool prefix cache (materialised by fork on a miss) with speculation.
  Each part is switchable: ``cache=False`` forks one workspace per trajectory from the
  root, ``fork=False`` takes plain CRIU snapshots instead of copy-on-write ones.

Every env hands out :class:`TrajectoryEnv` objects with one interface (``call``,
``workspace``, ``close``), the same as ``bunshin.cache.Trajectory``. Workspaces are
driven through :class:`~bunshin.workspace.AsyncWorkspace` (one call at a time each,
cancel-safe), blocking work through the one thread bridge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from ..cache import PrefixCache
from ..config import Config
from ..errors import InvalidArgument, SetupFailed
from ..runtime.state.records import SnapshotMode
from ..speculate import SpeculationPolicy
from ..tools import Tool, ToolSet
from ..tools.desktop import DESKTOP_TOOLS
from ..workspace import LocalHost
from ..workspace.aio import AsyncSnapshot, AsyncWorkspace, default_bridge
from ..workspace.desktop import Desktop, DesktopSpec
from ..workspace.protocol import HostAPI, SnapshotAPI, WorkspaceAPI
from .records import Observation
from .task import TaskSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_GRACE_S = 5.0  # past the tool's own timeout, the engine stops waiting for the call


class Mode(StrEnum):
    BASELINE = "baseline"
    COPY = "copy"
    BUNSHIN = "bunshin"


@dataclass(frozen=True)
class ModeOptions:
    """Ablation switches of the ``bunshin`` mode (ignored by the others)."""

    fork: bool = True  # copy-on-write snapshots (False: plain CRIU copies)
    cache: bool = True  # the tool prefix cache
    speculation: bool = True  # speculative execution (needs the cache)

    def effective(self, mode: Mode) -> dict[str, bool]:
        if mode == Mode.BASELINE:
            return {"fork": False, "cache": False, "speculation": False}
        if mode == Mode.COPY:
            return {"fork": False, "cache": False, "speculation": False}
        return {"fork": self.fork, "cache": self.cache, "speculation": self.cache and self.speculation}


class ToolRunner(Protocol):
    """What the engine needs of a tool set (``bunshin.tools.ToolSet``)."""

    def openai_tools(self) -> list[dict[str, Any]]: ...

    async def run(self, ws: AsyncWorkspace, name: str, args: dict[str, Any]) -> Any: ...


class TrajectoryEnv(Protocol):
    async def call(self, name: str, args: dict[str, Any]) -> Any: ...

    async def workspace(self) -> AsyncWorkspace: ...

    async def close(self) -> None: ...


async def in_thread(fn: Callable[[], T], *, undo: Callable[[T], object] | None = None) -> T:
    """Run blocking ``fn`` through the thread bridge; if the caller is cancelled meanwhile,
    ``undo`` its result (see :mod:`bunshin.workspace.aio`)."""
    return await default_bridge().run_sync(fn, undo=undo)


async def _remove_quietly(ws: AsyncWorkspace | AsyncSnapshot) -> None:
    try:
        await ws.remove()
    except Exception as e:  # cleanup after a failure must not mask it
        log.warning("cleanup failed: %s", e)


async def setup_workspace(ws: AsyncWorkspace, task: TaskSpec, tools: ToolRunner) -> None:
    """Write the task's files, then run its setup steps in order; :class:`SetupFailed` if one fails."""
    for path, content in task.files.items():
        await ws.files.write(path, content)
    for i, step in enumerate(task.setup):
        what = f"task {task.id}: setup step {i} ({step.describe()!r})"
        if step.tool is not None:
            obs = await asyncio.wait_for(tools.run(ws, step.tool, dict(step.arguments)), step.timeout)
            if obs.error or obs.timed_out or obs.exit_code not in (0, None):
                why = obs.error or ("timed out" if obs.timed_out else f"exit code {obs.exit_code}")
                raise SetupFailed(f"{what} failed: {why}", hint=obs.output[-500:] or None, step=i)
            continue
        run = step.run
        assert run is not None
        if step.background:
            await ws.commands.spawn(["sh", "-c", run])
            continue
        r = await ws.exec(run, timeout=step.timeout)
        if not r.ok:
            why = "timed out" if r.timed_out else f"exited {r.exit_code}"
            raise SetupFailed(f"{what} {why}", hint=(r.stderr or r.stdout)[-500:] or None, step=i)


def with_task_tools(tools: ToolRunner, task: TaskSpec) -> ToolRunner:
    """``tools`` plus, for a task with a desktop, the desktop tools the set lacks."""
    if not isinstance(tools, ToolSet) or task.desktop is None:
        return tools
    missing = [t for t in DESKTOP_TOOLS if t.name not in tools]
    return ToolSet([*tools, *missing], workdir=tools.workdir) if missing else tools


def scope_tools(tools: ToolRunner, task: TaskSpec) -> ToolRunner:
    """The task's view of a ``bunshin.tools.ToolSet``: only its tools, its timeout, its workdir
    (and, for a task with a desktop, the desktop tools the set lacks).

    Any other tool runner is used as it is.
    """
    if not isinstance(tools, ToolSet):
        return tools
    full = with_task_tools(tools, task)
    assert isinstance(full, ToolSet)
    picked = [t for t in full if task.tools is None or t.name in task.tools]
    return ToolSet([replace(t, spec=replace(t.spec, timeout=task.call_timeout)) for t in picked
                    if isinstance(t, Tool)], workdir=task.workdir)


class DirectTrajectory:
    """A trajectory on its own workspace: every call runs for real."""

    def __init__(self, ws: AsyncWorkspace, tools: ToolRunner, call_timeout: float) -> None:
        self._ws = ws
        self._tools = tools
        self._timeout = call_timeout

    async def call(self, name: str, args: dict[str, Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(self._tools.run(self._ws, name, args), self._timeout + CALL_GRACE_S)
        except TimeoutError:
            return Observation(output="", timed_out=True, duration_s=time.perf_counter() - t0,
                               error=f"no answer within {self._timeout:g}s")

    async def workspace(self) -> AsyncWorkspace:
        return self._ws

    async def close(self) -> None:
        await _remove_quietly(self._ws)


class TaskEnv:
    """Trajectories of one task in one mode. ``prepare`` once, ``open`` per trajectory."""

    def __init__(self, task: TaskSpec, tools: ToolRunner, config: Config, *, host: HostAPI | None = None) -> None:
        """``host``: where workspaces are made (default this machine under ``config``)."""
        self.task = task
        self.tools = scope_tools(tools, task)
        self.config = config
        self.host: HostAPI = host if host is not None else LocalHost(config)
        self.prepare_s = 0.0
        self.options: dict[str, bool] = {}  # the effective ablation switches (set by make_env)

    async def prepare(self) -> None:
        """Build what trajectories start from (the task root); nothing in baseline."""

    async def open(self, index: int) -> TrajectoryEnv:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Free the task root."""

    def new_group(self) -> None:
        """A new group (training iteration) of this task starts."""

    def stats(self) -> dict[str, Any]:
        return {}

    async def _create_and_setup(self) -> AsyncWorkspace:
        task, host = self.task, self.host
        if task.mounts and not isinstance(host, LocalHost):
            raise InvalidArgument(f"task {task.id}: host folder mounts need workspaces on this machine",
                                  hint="drop 'mounts' from the task, or run it with the local host")
        if task.network_kwargs() and not isinstance(host, LocalHost):
            raise InvalidArgument(f"task {task.id}: network (egress) in a task needs workspaces on this machine",
                                  hint="run it with the local host (or on `bunshin serve`'s own rollouts)")

        def create() -> WorkspaceAPI:
            if isinstance(host, LocalHost):
                return host.create(task.image, memory=task.memory, pids=task.pids, mounts=task.mounts,
                                   **task.network_kwargs())
            return host.create(task.image, memory=task.memory, pids=task.pids)

        ws = AsyncWorkspace(await in_thread(create, undo=lambda w: w.remove()))
        try:
            desktop = DesktopSpec.parse(task.desktop)
            if desktop is not None:  # before setup: a setup step may open an app on it
                await ws.call(Desktop.start, ws.sync, desktop)
            await setup_workspace(ws, task, self.tools)
        except BaseException:
            await asyncio.shield(_remove_quietly(ws))
            raise
        return ws


class BaselineEnv(TaskEnv):
    """A fresh workspace per trajectory, setup re-run each time."""

    async def open(self, index: int) -> TrajectoryEnv:
        ws = await self._create_and_setup()
        return DirectTrajectory(ws, self.tools, self.task.call_timeout)


class SnapshotEnv(TaskEnv):
    """Setup once, snapshot (``cow`` or ``copy``), one restore per trajectory."""

    def __init__(self, task: TaskSpec, tools: ToolRunner, config: Config, *,
                 snapshot_mode: SnapshotMode, host: HostAPI | None = None) -> None:
        super().__init__(task, tools, config, host=host)
        self.snapshot_mode = snapshot_mode
        self.root: AsyncSnapshot | None = None

    async def prepare(self) -> None:
        t0 = time.perf_counter()
        ws = await self._create_and_setup()
        try:
            self.root = await ws.snapshot(mode=self.snapshot_mode)
        finally:  # the snapshot keeps everything trajectories need
            await asyncio.shield(_remove_quietly(ws))
        self.prepare_s = time.perf_counter() - t0

    async def adopt(self, root: SnapshotAPI) -> None:
        """Start from ``root`` (this task's root copied from another host) instead of
        running setup; it is freed with the env."""
        self.root = AsyncSnapshot(root)

    async def open(self, index: int) -> TrajectoryEnv:
        assert self.root is not None, "prepare() first"
        (ws,) = await self.root.restore(1)
        return DirectTrajectory(ws, self.tools, self.task.call_timeout)

    async def aclose(self) -> None:
        if self.root is not None:
            root, self.root = self.root, None
            await _remove_quietly(root)


class CacheEnv(SnapshotEnv):
    """The task root behind a tool prefix cache (``bunshin.cache``), with optional speculation."""

    def __init__(self, task: TaskSpec, tools: ToolRunner, config: Config, *,
                 snapshot_mode: SnapshotMode, speculation: bool, host: HostAPI | None = None) -> None:
        super().__init__(task, tools, config, snapshot_mode=snapshot_mode, host=host)
        self.speculation = speculation
        self.cache: PrefixCache | None = None

    async def prepare(self) -> None:
        self._check_tools()
        await super().prepare()
        self._new_cache()

    async def adopt(self, root: SnapshotAPI) -> None:
        self._check_tools()
        await super().adopt(root)
        self._new_cache()

    def _check_tools(self) -> None:
        if not isinstance(self.tools, ToolSet):
            raise InvalidArgument(f"the prefix cache runs a bunshin ToolSet, not {type(self.tools).__name__}",
                                  hint="pass a ToolSet, or run with cache=False")

    def _new_cache(self) -> None:
        assert isinstance(self.tools, ToolSet)
        self.cache = PrefixCache(self.tools, speculation=SpeculationPolicy() if self.speculation else None)

    async def open(self, index: int) -> TrajectoryEnv:
        assert self.cache is not None and self.root is not None, "prepare() first"
        return self.cache.start(self.root.sync)

    def new_group(self) -> None:
        if self.cache is not None:
            self.cache.new_iteration()  # predictors weigh this group's siblings first

    async def aclose(self) -> None:
        if self.cache is not None:
            cache, self.cache = self.cache, None
            try:
                await cache.aclose()
            except Exception as e:
                log.warning("closing the prefix cache failed: %s", e)
        await super().aclose()

    def stats(self) -> dict[str, Any]:
        if self.cache is None:
            return {}
        return asdict(self.cache.stats())


class EnvPlacement(Protocol):
    """Makes a mode's :class:`TaskEnv` whose trajectories it places itself, e.g. over the
    hosts of a cluster (:class:`bunshin.cluster.ClusterPlacement`)."""

    def make_env(self, mode: Mode, task: TaskSpec, tools: ToolRunner, config: Config,
                 options: ModeOptions) -> TaskEnv: ...


def make_env(mode: Mode | str, task: TaskSpec, tools: ToolRunner, config: Config,
             options: ModeOptions | None = None, *, host: HostAPI | None = None) -> TaskEnv:
    """The :class:`TaskEnv` for ``mode`` with ``options``, its workspaces made on ``host``."""
    try:
        mode = Mode(mode)
    except ValueError:
        raise InvalidArgument(f"unknown mode {mode!r}", hint="one of: baseline, copy, bunshin") from None
    eff = (options or ModeOptions()).effective(mode)
    env: TaskEnv
    snapshot_mode = SnapshotMode.COW if eff["fork"] else SnapshotMode.COPY
    if mode == Mode.BASELINE:
        env = BaselineEnv(task, tools, config, host=host)
    elif eff["cache"]:
        env = CacheEnv(task, tools, config, snapshot_mode=snapshot_mode, speculation=eff["speculation"],
                       host=host)
    else:
        env = SnapshotEnv(task, tools, config, snapshot_mode=snapshot_mode, host=host)
    env.options = eff
    return env
