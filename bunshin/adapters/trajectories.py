"""What every framework adapter stands on: one trajectory of a group, forked from the group's root.

Frameworks drive environments synchronously (``env.step(action)``), often from inside
their own event loop or from worker threads, while bunshin's rollout engine is async.
So the adapters run the engine on one event loop of their own, in a daemon thread
(:class:`BackgroundLoop`), and every sync call waits for its coroutine there. All
environments of a process share one :class:`~bunshin.rollout.RolloutEngine` per mode
(:func:`engine`), so the copies of one task id in one process fork from one root,
behind one prefix cache.

A :class:`Trajectory` is the small interface the adapters use (``call``, ``reward``,
``close``), with two implementations:

- :class:`LocalTrajectory`: an engine :class:`~bunshin.rollout.Episode` in this process;
- :class:`ServedTrajectory`: a trajectory of the group ``key`` on a ``bunshin serve``
  host (``POST /v1/groups``): the copies of one key fork from one root whichever
  process (trainer worker, GPU rank) asks.

:func:`open_trajectory` picks one; :func:`close_all` frees every task root of the
process (also run at exit; a killed process leaves its roots and workspaces running: ``bunshin ls``,
``bunshin rm``).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol, TypeVar

from ..client import Client, RemoteTrajectory
from ..config import Config
from ..errors import InvalidArgument, StateConflict
from ..rollout import Episode, Mode, ModeOptions, RolloutEngine, TaskSpec, load_task, parse_task
from ..rollout.records import Action, new_id
from ..runtime.container.images import IMAGE_ID
from ..runtime.oci.refs import looks_like_ref
from ..tools import Observation, ToolCall
from ..workspace.protocol import WorkspaceAPI

T = TypeVar("T")


class BackgroundLoop:
    """An event loop in a daemon thread; ``run(coro)`` waits for it from any other thread,
    also from inside another running event loop (a framework calling ``env.step``)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="bunshin-adapters", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            coro.close()
            raise StateConflict("a blocking adapter call from the adapters' own event loop",
                                hint="await the coroutine instead of calling the sync method")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def stop(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


LOOP = BackgroundLoop()
_ENGINES: dict[tuple[Mode, str, ModeOptions], RolloutEngine] = {}
_CLIENTS: dict[tuple[str, str | None, str | None], Client] = {}
_ENGINES_LOCK = threading.Lock()


def engine(mode: Mode | str = Mode.BUNSHIN, *, config: Config | None = None,
           options: ModeOptions | None = None) -> RolloutEngine:
    """This process's engine for ``mode`` (one per mode, home and options): it keeps the
    task roots, so every environment of a task id in the process forks from one root."""
    try:
        mode = Mode(mode)
    except ValueError:
        raise InvalidArgument(f"unknown mode {mode!r}", hint="one of: baseline, copy, bunshin") from None
    cfg = config or Config.from_env()
    opts = options or ModeOptions()
    key = (mode, str(cfg.home), opts)
    with _ENGINES_LOCK:
        eng = _ENGINES.get(key)
        if eng is None:
            eng = _ENGINES[key] = RolloutEngine(mode, options=opts, config=cfg)
            LOOP.run(eng.__aenter__())
        return eng


def client(url: str, *, token: str | None = None, token_file: str | None = None) -> Client:
    """This process's :class:`~bunshin.client.Client` of ``url`` (one connection pool per host
    and token, shared by every environment of the process)."""
    key = (url.rstrip("/"), token, token_file)
    with _ENGINES_LOCK:
        c = _CLIENTS.get(key)
        if c is None:
            c = _CLIENTS[key] = Client(url, token=token, token_file=token_file)
        return c


def close_all() -> None:
    """Free every task root the adapters made in this process (their engines' roots and caches)
    and close their clients (a served group stays on its host for the other processes)."""
    with _ENGINES_LOCK:
        engines, clients = list(_ENGINES.values()), list(_CLIENTS.values())
        _ENGINES.clear()
        _CLIENTS.clear()
    for eng in engines:
        LOOP.run(eng.aclose())
    for c in clients:
        c.close()


# At exit, before the thread pools stop taking work (a root's removal goes through the thread
# bridge, whose pool refuses new calls once the interpreter shuts down): threading's own
# exit hooks run then, later-registered first; plain atexit runs too late.
_at_thread_exit = getattr(threading, "_register_atexit", None)
if _at_thread_exit is not None:
    _at_thread_exit(close_all)
else:  # pragma: no cover - every CPython >= 3.9 has it
    atexit.register(close_all)


def as_task(task: TaskSpec | Mapping[str, Any], *, task_id: str | None = None) -> TaskSpec:
    """A :class:`TaskSpec` from a spec or its JSON form, its id replaced by ``task_id`` if given."""
    spec = task if isinstance(task, TaskSpec) else parse_task(dict(task))
    if task_id is not None and task_id != spec.id:
        spec = parse_task({**spec.model_dump(mode="json"), "id": safe_id(task_id)}, source=f"task {task_id!r}")
    return spec


def row_task(row: Mapping[str, Any], *, where: str = "the dataset row") -> TaskSpec:
    """The task a dataset row names: ``task`` (a spec's JSON form) or ``task_file`` (a path).

    A row is data (downloaded, generated), not the trainer's own code, so a task in it may
    not reach into the host: no ``mounts`` (host folders shared into the workspace, where
    the model's code runs) and no host folder as its ``image`` ('host' or an image
    reference only). A ``task_file`` on the trainer's disk is taken as written.
    """
    if row.get("task") is not None:
        value = row["task"]
        spec = value if isinstance(value, TaskSpec) else as_task(dict(value))
        hint = "put such a task in a file on the trainer's host and give its path as 'task_file'"
        if spec.mounts:
            raise InvalidArgument(f"{where}: task {spec.id}: a task from a row may not share host folders (mounts)",
                                  hint=hint, field="task.mounts")
        if not _image_ref(spec.image):
            raise InvalidArgument(f"{where}: task {spec.id}: image {spec.image!r}: a task from a row runs on 'host' "
                                  "or an image reference, not a host folder", hint=hint, field="task.image")
        return spec
    if row.get("task_file"):
        return load_task(str(row["task_file"]))
    raise InvalidArgument(f"{where} names no bunshin task",
                          hint="give it a 'task' (a task spec as JSON) or a 'task_file' (a path)", field="task")


def _image_ref(image: str) -> bool:
    """'host', an image id, or a reference that is no path and names no folder here."""
    if image == "host" or IMAGE_ID.fullmatch(image):
        return True
    return (looks_like_ref(image) and not image.startswith(("/", ".", "~")) and not os.path.lexists(image))


def safe_id(text: str) -> str:
    """``text`` as a task id / group key (``[A-Za-z0-9_.:-]``, at most 128 characters)."""
    out = re.sub(r"[^A-Za-z0-9_.:-]", "_", str(text))[:128]
    if not out:
        raise InvalidArgument(f"empty id {text!r}", hint="give an instance_id made of letters, digits, _.:-")
    return out


class Trajectory(Protocol):
    """One trajectory forked from its group's root: tool calls, a reward, close."""

    @property
    def id(self) -> str: ...

    def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> Observation: ...

    def reward(self) -> float | None: ...

    def workspace(self) -> WorkspaceAPI:
        """Its workspace, brought up to date (from then on its calls run there uncached)."""
        ...

    def close(self) -> None: ...


class LocalTrajectory:
    """An engine episode of ``task`` in this process (a fork of the task's root in
    ``bunshin`` mode, a fresh workspace with setup re-run in ``baseline``)."""

    def __init__(self, ep: Episode) -> None:
        self._ep = ep
        self._closed = False

    @classmethod
    def open(cls, task: TaskSpec, *, mode: Mode | str = Mode.BUNSHIN, config: Config | None = None,
             options: ModeOptions | None = None, index: int = 0) -> LocalTrajectory:
        eng = engine(mode, config=config, options=options)

        async def start() -> Episode:
            env = await eng.env(task)
            ep = eng.episode(env, index, new_id(task.id))
            await ep.open()
            return ep

        return cls(LOOP.run(start()))

    @property
    def id(self) -> str:
        return self._ep.trajectory_id

    @property
    def episode(self) -> Episode:
        return self._ep

    def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> Observation:
        self._check_open()
        act = Action(tool_calls=(ToolCall(name, dict(arguments or {})),))
        (step,) = LOOP.run(self._ep.apply(act, 0.0))
        assert step.observation is not None
        return step.observation

    def reward(self) -> float | None:
        self._check_open()
        return LOOP.run(self._ep.reward())

    def workspace(self) -> WorkspaceAPI:
        self._check_open()
        traj = self._ep.traj
        assert traj is not None
        return LOOP.run(traj.workspace()).sync

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            LOOP.run(self._ep.close())

    def _check_open(self) -> None:
        if self._closed:
            raise StateConflict(f"trajectory {self.id} is closed", hint="open a new one (reset)")


class ServedTrajectory:
    """A trajectory of the group ``key`` on a ``bunshin serve`` host."""

    def __init__(self, remote: RemoteTrajectory) -> None:
        self._remote = remote

    @classmethod
    def open(cls, client: Client, task: TaskSpec, *, key: str) -> ServedTrajectory:
        grp = client.group(key=safe_id(key), n=1, task=task)
        return cls(grp.trajectories[0])

    @property
    def id(self) -> str:
        return self._remote.id

    @property
    def remote(self) -> RemoteTrajectory:
        return self._remote

    def call(self, name: str, arguments: Mapping[str, Any] | None = None) -> Observation:
        return self._remote.call(name, dict(arguments or {}))

    def reward(self) -> float | None:
        out = self._remote.reward()
        if out.status == "error":
            raise StateConflict(f"reward of {self.id}: {out.error}", hint=out.output[-300:] or None)
        return out.reward

    def workspace(self) -> WorkspaceAPI:
        return self._remote.workspace()

    def close(self) -> None:
        self._remote.close()


def open_trajectory(task: TaskSpec, *, key: str | None = None, client: Client | None = None,
                    mode: Mode | str = Mode.BUNSHIN, config: Config | None = None,
                    options: ModeOptions | None = None) -> Trajectory:
    """One trajectory of ``task``: on ``client``'s host in the group ``key`` (default the
    task id) when a client is given, else in this process (the task id is the group)."""
    if client is not None:
        return ServedTrajectory.open(client, task, key=key or task.id)
    if key is not None and safe_id(key) != task.id:
        task = as_task(task, task_id=key)
    return LocalTrajectory.open(task, mode=mode, config=config, options=options)


# --- tool calls written as text (the action of a text-in / text-out environment) -----------

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (the Hermes/Qwen chat format), or the whole text as one such JSON object or a list
    of them. No call found: an empty list (the text is a final answer). A block that is not
    a call raises :class:`InvalidArgument` saying what was wrong."""
    blocks = _TAGGED.findall(text)
    if not blocks:
        stripped = text.strip()
        if not stripped.startswith(("{", "[")):
            return []
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            return []
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in items):
            return []
        return [_call_of(v) for v in items]
    calls = []
    for block in blocks:
        try:
            value = json.loads(block)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"a <tool_call> block is not JSON: {e}",
                                  hint='write <tool_call>{"name": "bash", "arguments": {"command": "ls"}}'
                                       "</tool_call>") from None
        calls.append(_call_of(value))
    return calls


def _call_of(value: Any) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise InvalidArgument(f"a tool call needs a 'name': {str(value)[:120]}",
                              hint='{"name": "bash", "arguments": {"command": "ls"}}')
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise InvalidArgument(f"tool call {value['name']!r}: arguments are not JSON",
                                  hint="give arguments as an object") from None
    if not isinstance(args, dict):
        raise InvalidArgument(f"tool call {value['name']!r}: arguments must be an object",
                              hint="give arguments as an object")
    return ToolCall(value["name"], args)
