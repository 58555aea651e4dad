"""Gymnasium: a bunshin task as a real ``gymnasium.Env`` (text in, text out).

::

    import gymnasium, bunshin.adapters.gymnasium          # registers "bunshin/Task-v0"
    env = gymnasium.make("bunshin/Task-v0", task="task.yaml")
    obs, info = env.reset(seed=0)                          # obs: {"text": the prompt, "turn": 0}
    obs, reward, terminated, truncated, info = env.step('{"name": "bash", "arguments": {"command": "ls"}}')
    obs, reward, terminated, truncated, info = env.step("done")   # no tool call: the episode ends, scored

An action is the model's text: ``<tool_call>{...}</tool_call>`` blocks or one JSON call
(or a list of them) run as tool calls, anything else is the final answer. The
observation is ``{"text", "turn"}``: the prompt after ``reset``, the tool results after a
step. ``info`` has the chat so far (``messages``), and after ``reset`` the tools in the
OpenAI form and the trajectory id. The reward (0 until the end) is the task's reward
command in the final workspace. Built on :class:`~bunshin.rollout.RolloutEnv`: every
env of the process shares one engine, so N envs of one task (``gymnasium.make_vec``)
fork from one task root behind one prefix cache; ``mode="baseline"`` gives each its own
fresh workspace instead. The seed is gymnasium's (``np_random``); the workspace does not
depend on it.
"""

from __future__ import annotations

import copy
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium
import numpy as np
from gymnasium import spaces

from ..config import Config
from ..errors import InvalidArgument, StateConflict
from ..rollout import Mode, ModeOptions, RolloutEnv, TaskSpec, load_task
from .trajectories import LOOP, as_task, engine, parse_calls

ENV_ID = "bunshin/Task-v0"
MAX_CHARS = 65536


class AnyText(spaces.Text):
    """Any Unicode string of at most ``max_length`` characters (tool output is not limited to a
    charset); ``sample()`` draws printable ASCII."""

    def __init__(self, max_length: int, *, min_length: int = 0, seed: Any = None) -> None:
        charset = "".join(c for c in string.printable if c not in "\x0b\x0c")
        super().__init__(max_length, min_length=min_length, charset=charset, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"AnyText({self.min_length}, {self.max_length})"


def _task_of(task: TaskSpec | Mapping[str, Any] | str | Path) -> TaskSpec:
    if isinstance(task, str | Path):
        return load_task(task)
    return as_task(task)


class BunshinEnv(gymnasium.Env[dict[str, Any], str]):
    """One trajectory of ``task`` at a time; ``reset`` forks a new one from the task's root."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, task: TaskSpec | Mapping[str, Any] | str | Path, *, mode: Mode | str = Mode.BUNSHIN,
                 options: ModeOptions | None = None, config: Config | None = None,
                 max_chars: int = MAX_CHARS, render_mode: str | None = None) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise InvalidArgument(f"render_mode {render_mode!r}", hint="None or 'ansi'")
        self.task = _task_of(task)
        self.render_mode = render_mode
        self.max_chars = max_chars
        self.observation_space = spaces.Dict({"text": AnyText(max_chars),
                                              "turn": spaces.Discrete(self.task.max_turns + 1)})
        self.action_space = AnyText(max_chars, min_length=1)
        self._rollout = RolloutEnv(engine=engine(mode, config=config, options=options))
        self._index = 0
        self._text = ""
        self._turn = 0
        self._messages: list[dict[str, Any]] = []
        self._running = False

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A new trajectory forked from the task's root (any running one is closed first).
        ``options``: ``{"task": spec}`` switches to another task."""
        super().reset(seed=seed)
        if options and options.get("task") is not None:
            self.task = _task_of(options["task"])
            self.observation_space = spaces.Dict({"text": AnyText(self.max_chars),
                                                  "turn": spaces.Discrete(self.task.max_turns + 1)})
        obs, info = LOOP.run(self._rollout.areset(self.task, index=self._index))
        self._index += 1
        self._running = True
        self._messages = obs["messages"]
        text = "\n\n".join(str(m.get("content") or "") for m in self._messages)
        return self._obs(text, 0), {"trajectory_id": info["trajectory_id"], "tools": copy.deepcopy(obs["tools"]),
                                    "messages": copy.deepcopy(self._messages)}

    def step(self, action: str) -> tuple[dict[str, Any], SupportsFloat, bool, bool, dict[str, Any]]:
        if not self._running:
            raise StateConflict("step() without a running episode", hint="call reset() first")
        if not isinstance(action, str):
            raise InvalidArgument(f"an action is the model's text, not {type(action).__name__}",
                                  hint='a <tool_call>{"name": ..., "arguments": {...}}</tool_call> or a final answer')
        try:
            calls = parse_calls(action)
        except InvalidArgument as e:  # the model wrote a broken call: it sees why, the turn is not spent
            return self._obs(f"error: {e}", self._turn), 0.0, False, False, \
                {"status": "running", "messages": copy.deepcopy(self._messages)}
        act: Any = [{"name": c.name, "arguments": c.arguments} for c in calls] if calls else action
        obs, reward, terminated, truncated, info = LOOP.run(self._rollout.astep(act))
        self._messages = obs["messages"]
        self._turn = obs["turn"]
        out = {"status": info.get("status", "running"), "messages": copy.deepcopy(self._messages)}
        if terminated or truncated:
            self._running = False
            out["error"] = info.get("error")
            text = "" if terminated and not info.get("error") else str(info.get("error") or "")
        else:
            text = "\n\n".join(s.observation.text() for s in info.get("steps", []))
        return self._obs(text, self._turn), float(reward), bool(terminated), bool(truncated), out

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._text
        return None

    def close(self) -> None:
        """End the running trajectory (its workspace is removed); the task root stays with the
        process's engine (``bunshin.adapters.trajectories.close_all`` frees it)."""
        LOOP.run(self._rollout.aclose())  # the engine is shared: this ends the episode only
        self._running = False
        super().close()

    def _obs(self, text: str, turn: int) -> dict[str, Any]:
        self._text = text[-self.max_chars:]
        return {"text": self._text, "turn": np.int64(min(turn, self.task.max_turns))}


def register(env_id: str = ENV_ID, **kwargs: Any) -> str:
    """Register :class:`BunshinEnv` under ``env_id`` (``kwargs``: its defaults, e.g. ``task=``)."""
    if env_id not in gymnasium.registry:
        gymnasium.register(env_id, entry_point=f"{__name__}:BunshinEnv", kwargs=kwargs)
    return env_id


register()
