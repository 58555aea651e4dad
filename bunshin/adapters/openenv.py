"""OpenEnv: an OpenEnv environment server whose episodes are forks of a bunshin task root.

::

    python -m bunshin.adapters.openenv task.yaml --port 8000     # the server (loopback)

    from bunshin.adapters.openenv import BunshinAction, BunshinEnvClient
    with BunshinEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
        r = env.reset()                                          # r.observation.prompt
        r = env.step(BunshinAction(tool="bash", arguments={"command": "ls"}))
        r = env.step(BunshinAction(answer="done"))               # r.done, r.reward from the task

The app is openenv-core's own (``create_fastapi_app``): ``/reset``, ``/step``, ``/state``,
``/health``, ``/schema`` over HTTP and the stateful ``/ws`` WebSocket session its clients
(``EnvClient``, ``GenericEnvClient``) speak, so TRL's and SkyRL's OpenEnv integrations
connect unchanged. Each WebSocket session gets its own :class:`BunshinEnvironment`;
``reset`` forks the session's episode from the task's root (setup once, one prefix cache
for every session of the server process), ``reset(instance_id=...)`` picks the group.
With ``url`` the root lives on a ``bunshin serve`` host (its group key), so several
OpenEnv servers share it. HTTP ``/reset`` and ``/step`` are stateless in OpenEnv (a new
environment per request): a bare HTTP ``/step`` answers that there is no episode.
"""

from __future__ import annotations

import argparse
import functools
import uuid
from collections.abc import Mapping
from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
from openenv.core.env_server.types import EnvironmentMetadata
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from ..config import Config
from ..errors import InvalidArgument
from ..rollout import Mode, ModeOptions, TaskSpec, load_task
from .trajectories import Trajectory, as_task, client, open_trajectory, safe_id

MAX_SESSIONS = 64


class BunshinAction(Action):
    """A tool call (``tool`` + ``arguments``) or the final ``answer`` (ends the episode, scored)."""

    tool: str | None = Field(default=None, min_length=1, description="tool name: bash, read_file, edit, ...")
    arguments: dict[str, Any] = Field(default_factory=dict, description="the tool's arguments")
    answer: str | None = Field(default=None, description="the final answer: ends the episode")

    @model_validator(mode="after")
    def _one(self) -> BunshinAction:
        if (self.tool is None) == (self.answer is None):  # a custom error: OpenEnv sends it over JSON
            raise PydanticCustomError("bunshin_action", "give exactly one of 'tool' (a tool call) or 'answer' "
                                      "(the final answer)")
        return self


class BunshinObservation(Observation):
    """What the agent sees: the prompt after reset, a tool's output after a call."""

    prompt: str = ""
    output: str = ""
    exit_code: int | None = None
    error: str | None = None
    cached: bool = Field(default=False, description="served from the task's prefix cache")
    tools: list[str] = Field(default_factory=list)
    turn: int = 0


class BunshinState(State):
    trajectory_id: str | None = None
    task_id: str | None = None
    instance_id: str | None = None


class BunshinEnvironment(Environment[BunshinAction, BunshinObservation, BunshinState]):
    """One session's episodes of ``task`` (made per session by the server; no I/O until reset)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, task: TaskSpec, *, mode: Mode | str = Mode.BUNSHIN, options: ModeOptions | None = None,
                 config: Config | None = None, url: str | None = None, token: str | None = None,
                 token_file: str | None = None) -> None:
        super().__init__()
        self.task = task
        self._mode, self._options, self._config = mode, options, config
        self._url, self._token, self._token_file = url, token, token_file
        self._traj: Trajectory | None = None
        self._state = BunshinState(task_id=task.id)
        self._done = False

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> BunshinObservation:
        """A new episode forked from the root of ``instance_id`` (default the task id)."""
        self.close()
        key = safe_id(str(kwargs["instance_id"])) if kwargs.get("instance_id") else self.task.id
        task = self.task if key == self.task.id else as_task(self.task, task_id=key)
        remote = client(self._url, token=self._token, token_file=self._token_file) if self._url else None
        self._traj = open_trajectory(task, key=key, client=remote, mode=self._mode, config=self._config,
                                     options=self._options)
        self._state = BunshinState(episode_id=episode_id or uuid.uuid4().hex, step_count=0,
                                   trajectory_id=self._traj.id, task_id=self.task.id, instance_id=key)
        self._done = False
        return BunshinObservation(prompt=self.task.prompt, tools=list(self.task.tools or ()),
                                  metadata={"trajectory_id": self._traj.id})

    def step(self, action: BunshinAction, timeout_s: float | None = None, **kwargs: Any) -> BunshinObservation:
        traj = self._traj
        if traj is None or self._done:
            return BunshinObservation(done=True, error="no episode: reset first (over a WebSocket session: "
                                                       "HTTP /reset and /step are stateless in OpenEnv)")
        self._state.step_count += 1
        turn = self._state.step_count
        if action.answer is not None:
            return self._finish(turn)
        assert action.tool is not None
        obs = traj.call(action.tool, action.arguments)
        if turn >= self.task.max_turns:
            out = self._finish(turn)
            return out.model_copy(update={"output": obs.text(), "exit_code": obs.exit_code, "error": obs.error,
                                          "cached": obs.cached, "metadata": {**out.metadata, "truncated": True}})
        return BunshinObservation(output=obs.text(), exit_code=obs.exit_code, error=obs.error, cached=obs.cached,
                                  turn=turn)

    @property
    def state(self) -> BunshinState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(name=f"bunshin:{self.task.id}",
                                   description=f"bunshin task {self.task.id}: {self.task.prompt[:200]}")

    def close(self) -> None:
        """Remove the episode's workspace (the root stays for the other sessions)."""
        traj, self._traj = self._traj, None
        if traj is not None:
            traj.close()

    def _finish(self, turn: int) -> BunshinObservation:
        assert self._traj is not None
        self._done = True
        try:
            reward, error = float(self._traj.reward() or 0.0), None
        except Exception as e:  # the episode still ends; the client sees why it scored 0
            reward, error = 0.0, str(e)
        return BunshinObservation(done=True, reward=reward, error=error, turn=turn,
                                  metadata={"trajectory_id": self._traj.id})


def create_app(task: TaskSpec | Mapping[str, Any] | str, *, max_sessions: int = MAX_SESSIONS,
               **env_kw: Any) -> Any:
    """openenv-core's FastAPI app serving ``task`` (a spec, its JSON form or a task file);
    ``env_kw``: :class:`BunshinEnvironment`'s ``mode``, ``options``, ``config``, ``url``, ``token``."""
    spec = load_task(task) if isinstance(task, str) else (task if isinstance(task, TaskSpec) else as_task(task))
    if max_sessions < 1:
        raise InvalidArgument(f"max_sessions {max_sessions}", hint="at least 1")
    factory = functools.partial(BunshinEnvironment, spec, **env_kw)
    return create_fastapi_app(factory, BunshinAction, BunshinObservation, max_concurrent_envs=max_sessions)


class BunshinEnvClient(EnvClient[BunshinAction, BunshinObservation, BunshinState]):
    """openenv-core's WebSocket client, typed for this environment."""

    def _step_payload(self, action: BunshinAction) -> dict[str, Any]:
        return action.model_dump(exclude_none=True)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[BunshinObservation]:
        obs = BunshinObservation.model_validate({**payload.get("observation", {}), "done": payload.get("done", False),
                                                 "reward": payload.get("reward")})
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> BunshinState:
        return BunshinState.model_validate(payload)


def main(argv: list[str] | None = None) -> None:
    """``python -m bunshin.adapters.openenv TASK [--host H] [--port P] [--url BUNSHIN_SERVE_URL]``."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m bunshin.adapters.openenv")
    ap.add_argument("task", help="a task file (YAML or JSON)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--url", help="keep the task root on this bunshin serve host (token: BUNSHIN_TOKEN)")
    ap.add_argument("--max-sessions", type=int, default=MAX_SESSIONS)
    args = ap.parse_args(argv)
    uvicorn.run(create_app(args.task, max_sessions=args.max_sessions, url=args.url), host=args.host,
                port=args.port)


if __name__ == "__main__":
    main()
