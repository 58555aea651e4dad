"""Routes of groups and trajectories: one root and one prefix cache per group key, on the server.

The N trajectories of a rollout group reach the server from several processes (Ray
workers, one per GPU); they meet here by ``key``. The first ``POST /v1/groups`` of a
key builds the root (a task's files and setup run once in a new workspace, which is
then snapshotted copy-on-write and removed; or a fresh ``host`` workspace; or a
snapshot the caller names) and one :class:`~bunshin.cache.PrefixCache` with
speculation; every call with that key, from any process, then starts ``n`` new
trajectories of its own in that cache, so one trajectory's call is the next one's hit.

Everything here is async on uvicorn's event loop (the cache is asyncio; its blocking
work goes through the one thread bridge). Callers of one key queue on that key's
``asyncio.Lock`` while the root is built; other keys are not held up.

Records: ``key -> root`` is written to the store (kind ``group``) once the root exists,
so a restarted server finds the root again (its cache starts empty). Shutting the
server down closes every group's trajectories and cache (their workspaces and
snapshots go) but keeps roots and records; ``DELETE /v1/groups/{key}`` frees a group
for good (the root too, unless the caller gave it as ``snapshot``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Response

from ..api import groups as g
from ..api import models as m
from ..cache import PrefixCache, Trajectory
from ..config import Config
from ..errors import InvalidArgument, NotFound, SnapshotNotFound, StateConflict
from ..rollout.envs import SnapshotEnv, in_thread, scope_tools
from ..rollout.task import TaskSpec, parse_reward
from ..runtime.state.records import SnapshotMode
from ..runtime.state.store import Store
from ..speculate import SpeculationPolicy
from ..tools import ToolSet
from ..workspace import Snapshot, Workspace
from ..workspace.aio import AsyncSnapshot
from .context import ServerContext
from .images import check_image, image_id
from .tasks import http_task

log = logging.getLogger("bunshin.server")

#: The store's object kind of a group record (``key -> root``).
RECORD_KIND = "group"
#: Characters of a reward command's output kept in its answer.
REWARD_OUTPUT_CHARS = 2000


@dataclass(frozen=True)
class GroupRecord:
    """What the store keeps of a group (kind ``group``, id its key): enough to find its
    root again and to check a later caller's request against it."""

    key: str
    root: str
    owns_root: bool
    source: dict[str, Any]
    created_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: str) -> GroupRecord:
        return cls(**json.loads(data))


@dataclass
class Group:
    """One key's root, cache and open trajectories (``owns_root``: the server built it)."""

    key: str
    root: AsyncSnapshot
    owns_root: bool
    task: TaskSpec | None
    tools: ToolSet
    cache: PrefixCache
    source: dict[str, Any]
    trajectories: dict[str, Trajectory] = field(default_factory=dict)

    def out(self, made: list[str], *, created: bool = False) -> g.GroupOut:
        return g.GroupOut(key=self.key, root=self.root.id, task=self.task.id if self.task else None,
                          tools=[t.name for t in self.tools], speculation=self.cache.speculation is not None,
                          created=created,
                          trajectories=[trajectory_out(self.key, tid, self.trajectories[tid]) for tid in made])


def trajectory_out(key: str, tid: str, traj: Trajectory) -> g.TrajectoryOut:
    h = traj.handle
    s = traj.stats
    return g.TrajectoryOut(id=tid, key=key, workspace=h.ws.id if h is not None else None,
                           calls=s.calls, hits=s.hits, misses=s.misses)


class Groups:
    """Every group this server holds, by key, and their trajectories by id."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._groups: dict[str, Group] = {}
        self._key_locks: dict[str, asyncio.Lock] = {}
        self._trajs: dict[str, Group] = {}

    # --- groups -------------------------------------------------------------------------

    async def join(self, req: g.CreateGroup) -> g.GroupOut:
        """``req.n`` new trajectories in the group ``req.key``, built first if nobody has."""
        task, source = _plan(req)  # bad input fails before any waiting
        async with self._lock(req.key):
            grp = self._groups.get(req.key) or await self._load(req.key)
            created = grp is None
            if grp is None:
                grp = await self._build(req, task, source)
            elif grp.source != source:
                raise StateConflict(f"group {req.key!r} was made from another root, tools or speculation",
                                    hint="use a new key, or send the same image/snapshot/task and tools",
                                    key=req.key)
            made = [self._start(grp) for _ in range(req.n)]
            return grp.out(made, created=created)

    async def get(self, key: str) -> Group:
        async with self._lock(key):
            grp = self._groups.get(key) or await self._load(key)
        if grp is None:
            raise NotFound(f"no group {key!r}", hint="POST /v1/groups makes one", key=key)
        return grp

    async def remove(self, key: str) -> None:
        """Close the group's trajectories and cache, remove the root it owns, forget it."""
        async with self._lock(key):
            grp = self._groups.get(key) or await self._load(key)
            if grp is None:
                raise NotFound(f"no group {key!r}", hint="POST /v1/groups makes one", key=key)
            await self._close(grp)
            if grp.owns_root:
                try:
                    await grp.root.remove()
                except SnapshotNotFound:
                    pass
            await in_thread(lambda: self._delete_record(key))  # after the root: a record may outlive it

    async def aclose(self) -> None:
        """Close every group (server shutdown): roots and records stay for the next start."""
        for key in list(self._groups):
            async with self._lock(key):
                grp = self._groups.get(key)
                if grp is not None:
                    await self._close(grp)

    # --- trajectories ---------------------------------------------------------------------

    def trajectory(self, tid: str) -> tuple[Group, Trajectory]:
        grp = self._trajs.get(tid)
        if grp is None or tid not in grp.trajectories:
            raise NotFound(f"no trajectory {tid!r}", hint="POST /v1/groups makes trajectories; a closed one is "
                                                         "gone", trajectory=tid)
        return grp, grp.trajectories[tid]

    async def close_trajectory(self, tid: str) -> None:
        grp, traj = self.trajectory(tid)
        del grp.trajectories[tid]
        self._trajs.pop(tid, None)
        await traj.close()

    # --- inside -----------------------------------------------------------------------------

    def _lock(self, key: str) -> asyncio.Lock:
        """The key's lock, kept for the server's life: dropping it while a caller waits on
        it would let a newcomer build a second root beside that caller's."""
        return self._key_locks.setdefault(key, asyncio.Lock())

    def _start(self, grp: Group) -> str:
        tid = f"tr-{secrets.token_hex(6)}"
        grp.trajectories[tid] = grp.cache.start(grp.root.sync, key=grp.key)
        self._trajs[tid] = grp
        return tid

    async def _close(self, grp: Group) -> None:
        self._groups.pop(grp.key, None)
        for tid in grp.trajectories:
            self._trajs.pop(tid, None)
        grp.trajectories.clear()
        try:
            await grp.cache.aclose()
        except Exception as e:  # the root and the record must still be dealt with
            log.warning("closing the prefix cache of group %r failed: %s", grp.key, e)

    async def _build(self, req: g.CreateGroup, task: TaskSpec, source: dict[str, Any]) -> Group:
        if req.snapshot is not None:
            name = req.snapshot
            snap = await in_thread(lambda: Snapshot.get(name, config=self.config))
            root, owns = AsyncSnapshot(snap), False
            tools = _tools_of(task)
        else:
            image = await in_thread(lambda: image_id(self.config, task.image))  # pulled here if need be
            task = task.model_copy(update={"image": image})
            env = SnapshotEnv(task, ToolSet.default(), self.config, snapshot_mode=SnapshotMode.COW)
            await env.prepare()  # files and setup once, a copy-on-write root; its workspace goes
            assert env.root is not None
            root, owns = env.root, True
            assert isinstance(env.tools, ToolSet)
            tools = env.tools
        record = GroupRecord(req.key, root.id, owns, source, time.time())
        try:
            await in_thread(lambda: self._put_record(req.key, record))
        except BaseException:
            if owns:
                await asyncio.shield(root.remove())
            raise
        return self._adopt(req.key, root, owns, source, task, tools)

    async def _load(self, key: str) -> Group | None:
        """The group a previous server made (from its record), or None."""
        rec = await in_thread(lambda: self._get_record(key))
        if rec is None:
            return None
        try:
            snap = await in_thread(lambda: Snapshot.get(rec.root, config=self.config))
        except SnapshotNotFound:  # its root went: the record is stale, the key free again
            log.warning("group %r: root snapshot %s is gone; forgetting the group", key, rec.root)
            await in_thread(lambda: self._delete_record(key))
            return None
        task, _ = _plan(g.CreateGroup.model_validate({**rec.source, "n": 1}))
        return self._adopt(key, AsyncSnapshot(snap), rec.owns_root, rec.source, task, _tools_of(task))

    def _adopt(self, key: str, root: AsyncSnapshot, owns: bool, source: dict[str, Any], task: TaskSpec,
               tools: ToolSet) -> Group:
        spec = SpeculationPolicy() if source.get("speculation", True) else None
        grp = Group(key, root, owns, task if source.get("task") is not None else None, tools,
                    PrefixCache(tools, speculation=spec), source)
        self._groups[key] = grp
        return grp

    def _put_record(self, key: str, record: GroupRecord) -> None:
        with Store.open(self.config.db_path) as store:
            store.put_object(RECORD_KIND, key, record.to_json())

    def _get_record(self, key: str) -> GroupRecord | None:
        with Store.open(self.config.db_path) as store:
            data = store.get_object(RECORD_KIND, key)
        return GroupRecord.from_json(data) if data is not None else None

    def _delete_record(self, key: str) -> None:
        with Store.open(self.config.db_path) as store:
            store.delete_object(RECORD_KIND, key)


def _plan(req: g.CreateGroup) -> tuple[TaskSpec, dict[str, Any]]:
    """The task the group runs (the caller's, or a bare one for an image or snapshot root;
    ``req.tools``, built-in names, replaces the task's own list) and the group's source:
    what a later caller of the key must ask for too (the task in its checked form)."""
    source = req.source()
    if req.task is not None:
        task = http_task(req.task)
        source["task"] = task.model_dump(mode="json")
    else:
        if req.image is not None:
            check_image(req.image)
        task = TaskSpec(id=req.key, image=req.image or "host", memory=req.memory, pids=req.pids)
    names = req.tools if req.tools is not None else task.tools
    if names is not None:
        known = [t.name for t in ToolSet.default()]
        unknown = sorted(set(names) - set(known))
        if unknown or len(set(names)) != len(names):
            raise InvalidArgument(f"tools: unknown or repeated {unknown or list(names)}", field="tools",
                                  hint=f"the built-in tools: {', '.join(known)}")
        task = task.model_copy(update={"tools": tuple(names)})
    return task, source


def _tools_of(task: TaskSpec) -> ToolSet:
    """The built-in tools as the task sees them (its list, its call timeout, its workdir)."""
    tools = scope_tools(ToolSet.default(), task)
    assert isinstance(tools, ToolSet)
    return tools


def router(ctx: ServerContext) -> APIRouter:
    groups = Groups(ctx.config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await groups.aclose()

    r = APIRouter(prefix="/v1", lifespan=lifespan)

    @r.post("/groups", status_code=201)
    async def join(req: g.CreateGroup) -> g.GroupOut:
        return await groups.join(req)

    @r.get("/groups/{key}")
    async def get_group(key: str) -> g.GroupOut:
        grp = await groups.get(key)
        return grp.out(list(grp.trajectories))

    @r.delete("/groups/{key}", status_code=204)
    async def remove_group(key: str) -> Response:
        await groups.remove(key)
        return Response(status_code=204)

    @r.get("/trajectories/{tid}")
    async def get_trajectory(tid: str) -> g.TrajectoryOut:
        grp, traj = groups.trajectory(tid)
        return trajectory_out(grp.key, tid, traj)

    @r.post("/trajectories/{tid}/calls")
    async def call(tid: str, req: g.CallRequest) -> g.ObservationOut:
        _, traj = groups.trajectory(tid)
        obs = await traj.call(req.name, req.arguments)
        return g.ObservationOut(**asdict(obs))

    @r.get("/trajectories/{tid}/workspace")
    async def workspace(tid: str) -> m.WorkspaceOut:
        _, traj = groups.trajectory(tid)
        ws = (await traj.workspace()).sync
        local = ws if isinstance(ws, Workspace) else None
        return await in_thread(lambda: ctx.out(local or Workspace.get(ws.id, config=ctx.config)))

    @r.post("/trajectories/{tid}/reward")
    async def reward(tid: str) -> g.RewardOut:
        grp, traj = groups.trajectory(tid)
        spec = grp.task.reward if grp.task is not None else None
        if spec is None:
            return g.RewardOut(reward=None, status="none")
        ws = await traj.workspace()
        res = await ws.exec(spec.command, timeout=spec.timeout)
        tail = (res.stdout + res.stderr)[-REWARD_OUTPUT_CHARS:]
        base: dict[str, Any] = {"exit_code": res.exit_code, "output": tail, "duration_s": res.duration_s}
        if res.timed_out:
            return g.RewardOut(reward=None, status="error", error=f"reward command timed out after {spec.timeout:g}s",
                               **base)
        try:
            return g.RewardOut(reward=parse_reward(res.stdout), **base)
        except ValueError as e:
            return g.RewardOut(reward=None, status="error", error=f"reward command exited {res.exit_code}: {e}",
                               **base)

    @r.delete("/trajectories/{tid}", status_code=204)
    async def close(tid: str) -> Response:
        await groups.close_trajectory(tid)
        return Response(status_code=204)

    return r
