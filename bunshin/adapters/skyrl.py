"""SkyRL-gym: a bunshin task as a ``BaseTextEnv`` registered as ``bunshin``.

::

    import skyrl_gym, bunshin.adapters.skyrl               # registers env class "bunshin"
    env = skyrl_gym.make("bunshin", env_config={}, extras={"instance_id": "fix-17", "task": task_json})
    prompt, meta = env.init(prompt)                        # a fork of the instance's root
    out = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
    out = env.step("done")                                 # no tool call: done, out["reward"] from the task

SkyRL's generator makes one env per sample (``skyrl_gym.make(env_class, env_config=...,
extras=row)``) and repeats a prompt's row for its n samples, so the group is the
``instance_id`` of the row's extras (else ``extra_info.instance_id``, else the task id):
the copies of one instance fork from one root. In one process the adapters' engine
keeps that root (setup once, a copy-on-write snapshot, one prefix cache); with
``env_config.url`` (a ``bunshin serve`` host; ``token``/``token_file``, or
``BUNSHIN_TOKEN``) the server's group key does it across processes and machines.

``extras``: ``task`` (a task spec's JSON form) or ``task_file`` (YAML/JSON path);
``instance_id``; ``max_turns`` (SkyRL's generator sets it; default the task's).
``env_config``: ``mode`` (``bunshin`` default, ``baseline``: a fresh workspace and
setup per copy), ``cache`` and ``speculation`` (``bunshin`` mode's switches, default on),
``url``, ``token``, ``token_file``. An action is the model's text:
``<tool_call>{...}</tool_call>`` blocks (or one JSON call) run in order, their results
come back as one user message of ``<tool_response>`` blocks; text without a call ends
the episode and is scored by the task's reward command.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skyrl_gym import register as _skyrl_register
from skyrl_gym import registry as _skyrl_registry
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from ..config import Config
from ..errors import InvalidArgument, StateConflict
from ..rollout import Mode, ModeOptions, TaskSpec
from .trajectories import (
    Trajectory,
    as_task,
    client,
    open_trajectory,
    parse_calls,
    row_task,
    safe_id,
)

ENV_CLASS = "bunshin"


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """A key of a dict, an omegaconf ``DictConfig`` or ``None``."""
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    return getter(name, default) if getter is not None else getattr(cfg, name, default)


def task_of(extras: Mapping[str, Any]) -> TaskSpec:
    """The task named by a dataset row's extras (``task`` or ``task_file``; see ``row_task``)."""
    return row_task(extras, where="the row's extras")


def instance_of(extras: Mapping[str, Any], task: TaskSpec) -> str:
    info = extras.get("extra_info") or {}
    found = extras.get("instance_id") or (info.get("instance_id") if isinstance(info, Mapping) else None)
    return safe_id(str(found)) if found else task.id


class BunshinTextEnv(BaseTextEnv):
    """One copy of a task instance: ``init`` forks it from the instance's root."""

    def __init__(self, env_config: Any = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        self.task = task_of(extras)
        self.instance_id = instance_of(extras, self.task)
        self.max_turns = int(extras.get("max_turns") or self.task.max_turns)
        self.mode = str(_get(env_config, "mode", Mode.BUNSHIN.value))
        self.options = ModeOptions(cache=bool(_get(env_config, "cache", True)),
                                   speculation=bool(_get(env_config, "speculation", True)))
        self.url = _get(env_config, "url")
        self._token = _get(env_config, "token")
        self._token_file = _get(env_config, "token_file")
        config = _get(env_config, "config")
        self._config = config if isinstance(config, Config) else None
        self._traj: Trajectory | None = None
        self.calls = 0
        self.cached = 0
        self.reward: float | None = None

    def init(self, prompt: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Fork this copy from the instance's root; the prompt is returned as given (the
        task's own chat when SkyRL gives none)."""
        if self._traj is not None:
            raise StateConflict("init() twice on one env", hint="SkyRL makes one env per sample")
        remote = client(str(self.url), token=self._token, token_file=self._token_file) if self.url else None
        task = self.task if self.task.id == self.instance_id else as_task(self.task, task_id=self.instance_id)
        self._traj = open_trajectory(task, key=self.instance_id, client=remote, mode=self.mode,
                                     config=self._config, options=self.options)
        return (list(prompt) if prompt else task.initial_messages()), {"trajectory_id": self._traj.id,
                                                                       "instance_id": self.instance_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        traj = self._traj
        if traj is None:
            raise StateConflict("step() before init()", hint="call env.init(prompt) first")
        self.turns += 1
        try:
            calls = parse_calls(action)
        except InvalidArgument as e:
            return self._out(f"<tool_response>\nerror: {e}\n</tool_response>", done=False)
        if not calls:
            return self._finish()
        parts = []
        for call in calls:
            obs = traj.call(call.name, call.arguments)
            self.calls += 1
            self.cached += bool(obs.cached)
            parts.append(f"<tool_response>\n{obs.text()}\n</tool_response>")
        if self.turns >= self.max_turns:
            return self._finish()
        return self._out("\n".join(parts), done=False)

    def _finish(self) -> BaseTextEnvStepOutput:
        assert self._traj is not None
        error = None
        try:
            self.reward = self._traj.reward()
        except Exception as e:  # the episode still ends; the trainer sees why it scored 0
            error = str(e)
        return BaseTextEnvStepOutput(observations=[], reward=float(self.reward or 0.0), done=True,
                                     metadata={"reward_error": error, "trajectory_id": self._traj.id})

    def _out(self, text: str, *, done: bool) -> BaseTextEnvStepOutput:
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": text}], reward=0.0, done=done,
                                     metadata={})

    def close(self) -> None:
        """Remove this copy's workspace (the root stays for the instance's other copies)."""
        traj, self._traj = self._traj, None
        if traj is not None:
            traj.close()

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.calls, "cached_calls": self.cached}


def register(env_class: str = ENV_CLASS) -> str:
    """Register :class:`BunshinTextEnv` with skyrl_gym as ``env_class`` (once per process)."""
    if env_class not in _skyrl_registry:
        _skyrl_register(id=env_class, entry_point=f"{__name__}:BunshinTextEnv")
    return env_class


register()
