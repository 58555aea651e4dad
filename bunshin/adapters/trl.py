"""TRL: an ``environment_factory`` for ``GRPOTrainer`` whose tools run in a bunshin workspace.

::

    from bunshin.adapters.trl import BunshinToolEnv
    trainer = GRPOTrainer(model=..., train_dataset=ds,        # rows: prompt, task (JSON), instance_id
                          environment_factory=BunshinToolEnv.factory(url=None))

``GRPOTrainer`` makes one instance per rollout of a batch, keeps them in a pool and
reuses them: before each rollout it calls ``reset(**row)`` with the dataset row, then
the model calls the instance's public methods as tools (their type hints and
docstrings are the tool schemas), and ``get_reward()`` scores the finished rollout.
So ``reset`` closes the instance's previous trajectory and forks a new one from the
task's root: the G rollouts of one prompt (one ``instance_id``) start from one root
with one setup. TRL splits those G rollouts across processes (one per GPU), so with
``url`` (or ``BUNSHIN_URL``; the token from ``token``/``token_file``/``BUNSHIN_TOKEN``)
the root is the server's group ``instance_id``, shared by every process; without, the
process's own engine keeps it. ``get_reward`` runs the task's reward command in the
rollout's final workspace.

Rows: ``task`` (a task spec's JSON form) or ``task_file``; ``instance_id`` (default the
task id). The tools are ``bash``, ``read_file``, ``write_file``, ``edit`` and ``python``;
a task that allows fewer answers the others with an error. Subclass and drop methods
(or add some that call :meth:`BunshinToolEnv._call`) to change the tool set.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..config import Config
from ..errors import StateConflict
from ..rollout import Mode, ModeOptions, TaskSpec
from .trajectories import Trajectory, client, open_trajectory, row_task, safe_id


class BunshinToolEnv:
    """One rollout at a time; ``reset(**row)`` forks it from the row's task root."""

    _live: list[BunshinToolEnv] = []
    _live_lock = threading.Lock()

    def __init__(self, *, url: str | None = None, token: str | None = None, token_file: str | None = None,
                 mode: Mode | str = Mode.BUNSHIN, options: ModeOptions | None = None,
                 config: Config | None = None) -> None:
        self._url = url or os.environ.get("BUNSHIN_URL")
        self._token, self._token_file = token, token_file
        self._mode, self._options, self._config = mode, options, config
        self._traj: Trajectory | None = None
        self._task: TaskSpec | None = None
        self._reward: float | None = None
        with BunshinToolEnv._live_lock:
            BunshinToolEnv._live.append(self)

    @classmethod
    def factory(cls, **kw: Any) -> Callable[[], BunshinToolEnv]:
        """What to pass as ``environment_factory``: ``cls(**kw)`` per call (TRL calls it with no arguments)."""
        return functools.partial(cls, **kw)

    @classmethod
    def close_instances(cls) -> None:
        """Close every instance's trajectory (TRL never closes its pool): at the end of training."""
        with BunshinToolEnv._live_lock:
            live, BunshinToolEnv._live = list(BunshinToolEnv._live), []
        for env in live:
            cls._close(env)

    def reset(self, **row: Any) -> str | None:
        """Start a new rollout of the row's task, forked from its root (the previous one is closed).
        Returns the task's prompt when the row has none (TRL appends it to the last user message)."""
        self._close()
        task = row_task(row)
        key = safe_id(str(row["instance_id"])) if row.get("instance_id") else task.id
        remote = client(self._url, token=self._token, token_file=self._token_file) if self._url else None
        self._traj = open_trajectory(task, key=key, client=remote, mode=self._mode, config=self._config,
                                     options=self._options)
        self._task, self._reward = task, None
        prompt = row.get("prompt")
        has_prompt = bool(prompt) and not (isinstance(prompt, list) and not any(m.get("content") for m in prompt))
        return None if has_prompt else task.prompt

    def get_reward(self) -> float:
        """The task's reward command in this rollout's final workspace (0.0 when it has none)."""
        if self._reward is None:
            self._reward = float(self._trajectory().reward() or 0.0)
        return self._reward

    # --- the tools (public, typed and documented: TRL turns them into the tool schemas) ---

    def bash(self, command: str) -> str:
        """Run a shell command in the workspace's persistent bash session.

        Args:
            command: The command line; the working directory and exported variables persist between calls.

        Returns:
            The command's output and exit code.
        """
        return self._call("bash", {"command": command})

    def read_file(self, path: str) -> str:
        """Read a text file of the workspace.

        Args:
            path: The file's path, absolute or relative to the task's working directory.

        Returns:
            The file's content.
        """
        return self._call("read_file", {"path": path})

    def write_file(self, path: str, content: str) -> str:
        """Write (create or replace) a text file in the workspace.

        Args:
            path: The file's path, absolute or relative to the task's working directory.
            content: The new content of the whole file.

        Returns:
            What was written.
        """
        return self._call("write_file", {"path": path, "content": content})

    def edit(self, path: str, old_str: str, new_str: str) -> str:
        """Replace an exact string in a file of the workspace; it must occur exactly once.

        Args:
            path: The file's path, absolute or relative to the task's working directory.
            old_str: The text to replace (with enough context to be unique).
            new_str: The replacement.

        Returns:
            What changed, or why nothing did.
        """
        return self._call("edit", {"path": path, "old_str": old_str, "new_str": new_str})

    def python(self, code: str) -> str:
        """Run Python code in the workspace's persistent interpreter (variables persist between calls).

        Args:
            code: The code; the value of a last expression is shown.

        Returns:
            What it printed, and the last expression's value.
        """
        return self._call("python", {"code": code})

    # --- private (TRL takes every public method for a tool) ------------------------------

    def _call(self, name: str, arguments: Mapping[str, Any]) -> str:
        return self._trajectory().call(name, arguments).text()

    def _trajectory(self) -> Trajectory:
        if self._traj is None:
            raise StateConflict("no rollout: reset(**row) first", hint="GRPOTrainer calls reset before each rollout")
        return self._traj

    def _close(self) -> None:
        traj, self._traj = self._traj, None
        if traj is not None:
            traj.close()

