"""Rollouts over the cluster's hosts: ``RolloutEngine(mode, cluster=ClusterPlacement(...))``.

Each task gets a :class:`ClusterEnv`: the mode's own env (:func:`bunshin.rollout.envs.make_env`)
on every host it uses, so on each host trajectories fork from that host's copy of the
root and share that host's prefix cache (one tree per host). The root is built once
(setup on the first host chosen), saved to the head (``spool``) and loaded onto any
other host a trajectory is placed on (save -> transfer -> load, once per host).

Faults: when a call fails and its host no longer answers, the host is marked dead
(no more placements), the trajectory is opened again on another host from the root and
its calls so far replayed there (deterministic tools give the same state), then the
failed call is run again; the row's ``placement`` says what happened. With a
``membership`` (the :class:`~bunshin.cluster.Cluster`: :meth:`ClusterPlacement.of`), a host
marked dead is also fenced (:mod:`bunshin.cluster.fence`): its actor empties its home,
and once it serves the new epoch and answers again (a partition healed, a node back)
it takes placements again, its old copies of the roots forgotten.

The membership is also watched (every :data:`REVIVE_S`): a host whose Ray node the GCS
counts dead is given up like one that does not answer, even while its server still
answers over HTTP (a partition of the node from Ray, not from the head): its host cannot
renew its lease, so it will empty itself. Its trajectories move before their next call
(one waiting on a call there stops within :data:`WATCH_S`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import httpx

from ..config import Config
from ..errors import Unreachable
from ..rollout.envs import (
    Mode,
    ModeOptions,
    SnapshotEnv,
    TaskEnv,
    ToolRunner,
    TrajectoryEnv,
    in_thread,
    make_env,
)
from ..rollout.task import TaskSpec
from ..runtime.container.cgroups import parse_size
from ..workspace.aio import AsyncWorkspace
from .copies import COPY_TTL_S, CopyLeases
from .images import ImageMove, ImageMover
from .records import HostLimits
from .scheduler import HostLoad, choose

if TYPE_CHECKING:
    from ..client import Client
    from ..client.remote import RemoteSnapshot
    from .ray_cluster import Cluster
    from .records import Endpoint

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 3.0
#: A host that does not answer its health checks for this long is given up (fenced); one
#: where nothing listens, at once.
DEAD_AFTER_S = 10.0
#: While a call on a host runs longer than this, the host's health is checked this often
#: (a host that stops answering, e.g. behind a partition, would otherwise hold the call
#: until its own timeout); an answer is reused for as long.
WATCH_S = 2.0
MAX_RETRIES = 3
#: How often hosts marked dead are looked at again (fenced, serving again, answering?).
REVIVE_S = 1.0
T = TypeVar("T")


class Membership(Protocol):
    """What the placement asks of the cluster about hosts it gave up (:class:`Cluster`)."""

    def fence(self, name: str) -> int: ...

    def serving(self, name: str) -> int | None: ...

    def endpoint(self, name: str) -> Endpoint | None: ...

    def live(self) -> set[str]: ...


@dataclass
class Counters:
    """What the placement did, for reports and the benchmark."""

    placements: int = 0
    migrations: int = 0
    retries: int = 0
    dead_hosts: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # dead host -> why it was given up (the last time)
    revived: list[str] = field(default_factory=list)  # hosts placed on again after a fence
    place_s: float = 0.0  # time spent in the scheduler's decisions
    migrate_s: float = 0.0  # time spent saving and loading roots


class ClusterPlacement:
    """The hosts a rollout may use: a :class:`bunshin.client.Client` per host name, with
    the caps each was started with. Close it when done (it closes the clients)."""

    def __init__(self, hosts: Mapping[str, Client], *, limits: Mapping[str, HostLimits] | None = None,
                 spool: Path | None = None, membership: Membership | None = None,
                 copy_ttl: float = COPY_TTL_S) -> None:
        if not hosts:
            raise Unreachable("no host to place trajectories on", hint="see `bunshin cluster status`")
        self.hosts = dict(hosts)
        self.limits = {n: (limits or {}).get(n, HostLimits()) for n in self.hosts}
        self.running = dict.fromkeys(self.hosts, 0)
        self.roots = dict.fromkeys(self.hosts, 0)  # task roots built on each host
        self.dead: set[str] = set()
        self._lock = threading.Lock()
        self._answered: dict[str, float] = {}  # host -> when it last answered a health check
        self.counters = Counters()
        self._own_spool = spool is None
        self.spool = Path(spool) if spool is not None else Path(tempfile.mkdtemp(prefix="bunshin-roots-"))
        self.membership = membership
        self.fenced: dict[str, int] = {}  # dead host -> the epoch it must serve to be placed on again
        self.generation = dict.fromkeys(self.hosts, 0)  # a host's epochs seen here: roots held there go
        self.epochs: dict[str, int | None] = {}  # the epoch each host served when last seen here
        self._retired: list[Client] = []  # clients of hosts given up, then back
        self.copies = CopyLeases(self.hosts, ttl=copy_ttl)  # the roots put on hosts, leased to this head
        self._closed = threading.Event()
        self._reviver: threading.Thread | None = None  # the watch on the membership and the hosts given up
        self.images = ImageMover(self.hosts, self.dead)  # a task's image onto a host lacking it

    @classmethod
    def of(cls, cluster: Cluster, *, spool: Path | None = None, copy_ttl: float = COPY_TTL_S) -> ClusterPlacement:
        """Every live host of ``cluster``; the roots put on them are leased for ``copy_ttl``
        seconds, renewed while this head lives (:mod:`bunshin.cluster.copies`)."""
        limits = {h.name: h.limits for h in cluster.status() if h.alive}
        clients = {n: c for n, c in cluster.clients().items() if n in limits}
        placement = cls(clients, limits=limits, spool=spool, membership=cluster, copy_ttl=copy_ttl)
        placement.watch()
        return placement

    def watch(self) -> None:
        """Start watching the membership (hosts whose Ray node died are given up) and the
        hosts given up (placed on again once back); :meth:`close` stops it."""
        if self.membership is None:
            return
        with self._lock:
            if self._reviver is None:
                self._reviver = threading.Thread(target=self._revive_loop, name="bunshin-revive", daemon=True)
                self._reviver.start()

    def make_env(self, mode: Mode, task: TaskSpec, tools: ToolRunner, config: Config,
                 options: ModeOptions) -> TaskEnv:
        return ClusterEnv(self, mode, task, tools, config, options)

    def loads(self, holders: set[str], image_holders: set[str] | None = None) -> list[HostLoad]:
        return [HostLoad(n, alive=n not in self.dead, holds_root=n in holders, running=self.running[n],
                         max_workspaces=lim.max_workspaces, max_memory=lim.max_memory,
                         holds_image=n in (image_holders or ()))
                for n, lim in self.limits.items()]

    def root_host(self, memory: int | None, image_holders: set[str] | None = None) -> str:
        """Where a new task root is built: the live host with the fewest roots built there
        (tasks spread, then each group stays next to its root), then the most room, then
        one holding the task's image (``image_holders``: none is moved)."""
        loads = [h for h in self.loads(set(), image_holders) if h.alive]
        if not loads:
            return choose(loads, memory=memory).host  # raises: no live host
        best = min(loads, key=lambda h: (self.roots[h.name], -(h.slots(memory) or 1 << 30), not h.holds_image,
                                         h.name))
        self.roots[best.name] += 1
        return best.name

    def alive(self, name: str, *, max_age: float = 0.0) -> bool:
        """Does host ``name`` answer its health check (one made within ``max_age`` seconds
        will do)? A host that does not is marked dead."""
        if name in self.dead:
            return False
        if time.monotonic() - self._answered.get(name, -1e9) < max_age:
            return True
        ok = self._health(name)
        if ok:
            self._answered[name] = time.monotonic()
        else:
            self.give_up(name, "does not answer")
        return ok

    def give_up(self, name: str, why: str) -> None:
        """No more placements on host ``name`` (its trajectories move), and it is fenced."""
        with self._lock:  # trajectories of one host find it dead at once, from threads
            if name in self.dead:
                return
            self.dead.add(name)
            self.counters.dead_hosts.append(name)
            self.counters.why[name] = why
            log.warning("host %s %s: no more placements there", name, why)
        self._fence(name)

    def _health(self, name: str) -> bool:
        """A health check: nothing listening there is an answer at once; no answer in
        time (a busy host, or one cut off) is asked again until :data:`DEAD_AFTER_S`."""
        deadline = time.monotonic() + DEAD_AFTER_S
        while True:
            try:
                return httpx.get(f"{self.hosts[name].url}/v1/health", timeout=HEALTH_TIMEOUT_S).status_code == 200
            except httpx.ConnectError:
                return False
            except httpx.HTTPError:
                if time.monotonic() >= deadline:
                    return False

    def _fence(self, name: str) -> None:
        """Tell the cluster its work there is given up; watch for it to come back."""
        if self.membership is None:
            return
        try:
            self.fenced[name] = self.membership.fence(name)
        except Exception as e:  # the cluster itself does not answer: the host stays dead here
            log.warning("could not fence host %s: %s", name, e)
            return
        self.watch()

    def _revive_loop(self) -> None:
        assert self.membership is not None
        while not self._closed.wait(REVIVE_S):
            try:
                live = self.membership.live()
            except Exception as e:  # the GCS does not answer the head: nothing to conclude
                log.debug("membership unknown: %s", e)
            else:
                for name in sorted(set(self.hosts) - live - self.dead):
                    self.give_up(name, "is on a Ray node the cluster counts dead")
                for name in sorted(live & set(self.hosts) - self.dead):
                    self._check_epoch(name)
            for name, epoch in list(self.fenced.items()):
                try:
                    self._revive(name, epoch)
                except Exception as e:
                    log.debug("host %s not back yet: %s", name, e)

    def _check_epoch(self, name: str) -> None:
        """A host serving a newer epoch than the one seen here emptied itself (its lease ran
        out unrenewed, e.g. the GCS was slow to answer it): what it held is gone, so it is
        given up (its trajectories move) and placed on again once it answers."""
        assert self.membership is not None
        try:
            now = self.membership.serving(name)
        except Exception:
            return
        seen = self.epochs.setdefault(name, now)
        if now is not None and seen is not None and now > seen:
            self.give_up(name, f"serves a new epoch ({now}): it emptied itself")
        elif now is not None:
            self.epochs[name] = now

    def _revive(self, name: str, epoch: int) -> None:
        """Host ``name`` serves ``epoch`` (or later: its home emptied) and answers: placed on again."""
        assert self.membership is not None
        serving = self.membership.serving(name)
        if serving is None or serving < epoch or name not in self.membership.live():
            return
        ep = self.membership.endpoint(name)
        if ep is None or httpx.get(f"{ep.url}/v1/health", timeout=HEALTH_TIMEOUT_S).status_code != 200:
            return
        from ..client import Client, Retry
        from .transport import keepalive_transport

        with self._lock:
            # the old client's calls still retrying meet the new epoch's token: refused (401)
            self._retired.append(self.hosts[name])
            self.hosts[name] = Client(ep.url, token=ep.token, timeout=300.0, retry=Retry(total_s=60.0),
                                      transport=keepalive_transport())
            self.generation[name] += 1
            self.epochs[name] = serving
            self.fenced.pop(name, None)
            self._answered[name] = time.monotonic()
            self.dead.discard(name)
            self.counters.revived.append(name)
        log.warning("host %s serves again (epoch %d): placed on again", name, serving)

    def close(self) -> None:
        self._closed.set()
        self.copies.close()
        if self._reviver is not None:
            self._reviver.join()
        for c in [*self.hosts.values(), *self._retired]:
            c.close()
        if self._own_spool:
            shutil.rmtree(self.spool, ignore_errors=True)

    def __enter__(self) -> ClusterPlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ClusterEnv(TaskEnv):
    """One task's trajectories over the cluster: the mode's env on each host it uses."""

    def __init__(self, placement: ClusterPlacement, mode: Mode, task: TaskSpec, tools: ToolRunner,
                 config: Config, options: ModeOptions) -> None:
        first = next(iter(placement.hosts.values()))
        super().__init__(task, tools, config, host=first)
        self.placement, self.mode, self.mode_options = placement, mode, options
        self.subs: dict[str, TaskEnv] = {}
        self._gen: dict[str, int] = {}  # the host's generation each sub was made in
        self.saved: Path | None = None  # the root, saved on the head
        self.built_on: str | None = None  # the host its setup ran on
        self.memory = parse_size(task.memory) if task.memory else None
        self._locks: dict[str, asyncio.Lock] = {}
        self._copying: set[str] = set()  # hosts the root is being copied to
        self.image_moves: dict[str, ImageMove] = {}  # host -> the move that brought the task's image
        self.image_hosts: set[str] = set()  # hosts holding the task's image whole (asked in prepare)
        probe = make_env(mode, task, tools, config, options, host=first)
        self.options = dict(probe.options)
        self.needs_root = isinstance(probe, SnapshotEnv)

    def _sub(self, name: str) -> TaskEnv:
        return make_env(self.mode, self.task, self.tools, self.config, self.mode_options,
                        host=self.placement.hosts[name])

    def _choose(self) -> tuple[str, bool]:
        t0 = time.perf_counter()
        c = choose(self.placement.loads(set(self._current()) | self._copying, self.image_hosts),
                   memory=self.memory, needs_root=self.needs_root)
        self.placement.counters.place_s += time.perf_counter() - t0
        self.placement.counters.placements += 1
        # reserved before any await: concurrent opens see the slot taken and the copy coming
        self.placement.running[c.host] += 1
        if c.migrate and self.needs_root:
            self._copying.add(c.host)
        return c.host, c.migrate

    def _current(self) -> dict[str, TaskEnv]:
        """The subs of hosts still in the generation they were made in (a host fenced and
        back has lost what it held)."""
        return {n: s for n, s in self.subs.items() if self._gen.get(n) == self.placement.generation[n]}

    def _keep(self, name: str, sub: TaskEnv) -> None:
        self.subs[name] = sub
        self._gen[name] = self.placement.generation[name]

    async def prepare(self) -> None:
        """The root on the first host chosen (setup once there), saved on the head."""
        if not self.needs_root:
            return
        t0 = time.perf_counter()
        self.image_hosts = await in_thread(lambda: self.placement.images.holders(self.task.image))
        for _ in range(len(self.placement.hosts)):  # a host that dies meanwhile: the next one
            host = self.placement.root_host(self.memory, self.image_hosts)
            sub = self._sub(host)
            try:
                await self._image_on(host)
                await self.guarded(host, sub.prepare())
                break
            except Exception:
                self.placement.roots[host] -= 1
                if not await in_thread(lambda h=host: self.placement.alive(h)):  # type: ignore[misc]
                    continue
                raise
        else:
            raise Unreachable(f"task {self.task.id}: no host could build its root",
                              hint="see `bunshin cluster status`")
        self.built_on = host
        self._keep(host, sub)
        assert isinstance(sub, SnapshotEnv) and sub.root is not None
        root: RemoteSnapshot = sub.root.sync  # type: ignore[assignment]
        leases = self.placement.copies  # the root outlives this head only by its lease
        await in_thread(lambda: root.set_ttl(leases.ttl))
        leases.add(host, root.id)
        dest = self.placement.spool / f"{self.task.id}-{uuid.uuid4().hex[:8]}"
        self.saved = await in_thread(lambda: root.save(dest))
        self.prepare_s = time.perf_counter() - t0

    async def _env_on(self, name: str) -> TaskEnv:
        """The env on host ``name``; its copy of the root loaded first if it has none."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            sub = self._current().get(name)
            if sub is not None:
                return sub
            sub = self._sub(name)
            if self.needs_root:
                assert isinstance(sub, SnapshotEnv) and self.saved is not None, "prepare() first"
                t0 = time.perf_counter()
                client, saved = self.placement.hosts[name], self.saved
                try:
                    await self._image_on(name)  # the root's image layers are named, not carried
                    snap = await in_thread(lambda: client.load_snapshot(saved, ttl=self.placement.copies.ttl),
                                           undo=lambda s: s.remove())
                    self.placement.copies.add(name, snap.id)
                finally:
                    self._copying.discard(name)
                await sub.adopt(snap)
                self.placement.counters.migrations += 1
                self.placement.counters.migrate_s += time.perf_counter() - t0
            self._keep(name, sub)
            return sub

    async def _image_on(self, name: str) -> None:
        """The task's image on host ``name``, moved from a holder if it lacks it."""
        move = await in_thread(lambda: self.placement.images.ensure(self.task.image, name))
        if move is not None:
            self.image_moves[name] = move
            self.image_hosts.add(name)

    async def open_on(self, events: list[str]) -> tuple[str, TrajectoryEnv]:
        """A trajectory on the host the scheduler picks; a host that fails and no longer
        answers is marked dead (said in ``events``) and the next one tried."""
        for _ in range(len(self.placement.hosts)):
            name, _ = self._choose()
            try:
                sub = await self.guarded(name, self._env_on(name))
                return name, await self.guarded(name, sub.open(0))
            except Exception as e:
                self.placement.running[name] -= 1
                if await in_thread(lambda n=name: self.placement.alive(n)):  # type: ignore[misc]
                    raise
                events.append(f"host {name} died while opening ({type(e).__name__}); placed again")
        raise Unreachable(f"task {self.task.id}: every host failed", hint="see `bunshin cluster status`")

    async def guarded(self, host: str, op: Awaitable[T]) -> T:
        """``op`` on ``host``, given up (:class:`Unreachable`) if the host stops answering
        meanwhile (checked every :data:`WATCH_S` while it runs)."""
        task = asyncio.ensure_future(op)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_S)
                if done:
                    return task.result()
                if not await in_thread(lambda: self.placement.alive(host, max_age=WATCH_S)):
                    raise Unreachable(f"host {host} stopped answering", hint="see `bunshin cluster status`")
        finally:
            if not task.done():
                task.cancel()

    async def open(self, index: int) -> TrajectoryEnv:
        traj = ClusterTrajectory(self)
        await traj.start()
        return traj

    def release(self, name: str) -> None:
        self.placement.running[name] -= 1

    def new_group(self) -> None:
        for sub in self.subs.values():
            sub.new_group()

    def stats(self) -> dict[str, Any]:
        per_host = {n: st for n, sub in self.subs.items() if (st := sub.stats())}
        return {"hosts": per_host} if per_host else {}

    async def aclose(self) -> None:
        subs, current, self.subs = self.subs, self._current(), {}
        for name, sub in subs.items():
            if name in self.placement.dead or name not in current:
                continue  # its server is gone (or was emptied): its own gc or fence cleans what it held
            try:
                await sub.aclose()
            except Exception as e:
                log.warning("closing task %s on %s failed: %s", self.task.id, name, e)
        if self.saved is not None:
            shutil.rmtree(self.saved, ignore_errors=True)
            self.saved = None
        if self.built_on is not None:
            self.placement.roots[self.built_on] -= 1
            self.built_on = None


class ClusterTrajectory:
    """A trajectory on one host, moved to another (from the root, its calls replayed)
    when its host dies."""

    def __init__(self, env: ClusterEnv) -> None:
        self.env = env
        self.host = ""
        self.gen = 0  # the host's generation when this trajectory was placed there
        self.inner: TrajectoryEnv | None = None
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.placement: dict[str, Any] = {"host": "", "hosts": [], "retries": 0, "events": []}

    async def start(self) -> None:
        self.host, self.inner = await self.env.open_on(self.placement["events"])
        self.gen = self.env.placement.generation[self.host]
        self.placement["host"] = self.host
        self.placement["hosts"].append(self.host)
        move = self.env.image_moves.get(self.host)
        if move is not None:  # the task's image came to this host for this group
            self.placement["image"] = move.to_dict()

    async def move(self, why: str) -> None:
        """Open again on another host and replay the calls made so far."""
        if self.placement["retries"] >= MAX_RETRIES:
            raise Unreachable(f"trajectory moved {MAX_RETRIES} times: {why}")
        old = self.host
        self.env.release(old)
        self.inner = None
        await self.start()
        for name, args in self.calls:
            await self.env.guarded(self.host, self._inner().call(name, args))
        self.placement["retries"] += 1
        self.env.placement.counters.retries += 1
        self.placement["events"].append(f"host {old} died ({why}); from the root on {self.host}, "
                                        f"{len(self.calls)} call(s) replayed")

    def _inner(self) -> TrajectoryEnv:
        assert self.inner is not None
        return self.inner

    async def host_died(self) -> bool:
        name = self.host
        return not await in_thread(lambda: self.env.placement.alive(name))

    def given_up(self) -> bool:
        """Its host was given up (or fenced and back, emptied) since it was placed there."""
        placement = self.env.placement
        return self.host in placement.dead or placement.generation[self.host] != self.gen

    async def call(self, name: str, args: dict[str, Any]) -> Any:
        while True:
            if self.given_up():  # e.g. its Ray node died while its server still answers
                await self.move(f"host {self.host} was given up")
                continue
            try:
                obs = await self.env.guarded(self.host, self._inner().call(name, args))
            except Exception as e:
                if not await self.host_died():
                    raise
                await self.move(f"{type(e).__name__}: {e}")
                continue
            if getattr(obs, "error", None) and await self.host_died():
                await self.move(str(obs.error)[:200])
                continue
            self.calls.append((name, dict(args)))
            return obs

    async def workspace(self) -> AsyncWorkspace:
        """The workspace, its ``exec`` watched: a host that dies under the reward command
        moves the trajectory (from the root, its calls replayed) and the command runs again."""
        return cast(AsyncWorkspace, WatchedWorkspace(self, await self.current_workspace()))

    async def current_workspace(self) -> AsyncWorkspace:
        while True:
            if self.given_up():
                await self.move(f"host {self.host} was given up")
            inner = self._inner()
            try:
                ws = await self.env.guarded(self.host, inner.workspace())
                if await self.env.guarded(self.host, ws.is_alive()):
                    return ws
                raise Unreachable("the trajectory's workspace is gone")
            except Exception as e:
                if not await self.host_died():
                    raise
                await self.move(f"{type(e).__name__}: {e}")

    async def close(self) -> None:
        inner, self.inner = self.inner, None
        if inner is None:
            return
        self.env.release(self.host)
        placement = self.env.placement
        if self.host in placement.dead or placement.generation[self.host] != self.gen:
            return  # nothing to free there now: that host's fence (or gc) does
        await inner.close()


class WatchedWorkspace:
    """A trajectory's workspace whose ``exec`` (the engine's reward command) is watched
    like its tool calls; everything else is the workspace's own."""

    def __init__(self, traj: ClusterTrajectory, ws: AsyncWorkspace) -> None:
        self._traj, self._ws = traj, ws

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ws, name)

    async def exec(self, *args: Any, **kwargs: Any) -> Any:
        traj = self._traj
        while True:
            if traj.given_up():
                await traj.move(f"host {traj.host} was given up")
                self._ws = await traj.current_workspace()
            try:
                return await traj.env.guarded(traj.host, self._ws.exec(*args, **kwargs))
            except Exception as e:
                if not await traj.host_died():
                    raise
                await traj.move(f"{type(e).__name__} in exec: {e}")
                self._ws = await traj.current_workspace()
