"""rLLM: a ``BaseEnv`` over a bunshin trajectory, and a workspace behind rLLM's sandbox protocol.

::

    from bunshin.adapters.rllm import BunshinEnv, BunshinSandbox
    env = BunshinEnv.from_dict({"task": task_json, "instance_id": "fix-17"})
    obs, info = env.reset()                        # a fork of the instance's root; obs["prompt"]
    obs, reward, done, info = env.step({"name": "bash", "arguments": {"command": "ls"}})
    obs, reward, done, info = env.step("done")     # no tool call: done, scored by the task
    sb = env.sandbox()                             # the same workspace as an rLLM Sandbox
    sb.exec("pytest -q"); sb.upload_dir("./fixtures", "/work/fixtures"); env.close()

rLLM is not on PyPI, so this follows its source: ``BaseEnv`` (``reset() -> (obs, info)``,
``step(action) -> (obs, reward, done, info)``, ``close``, the static ``from_dict(info)``,
``idx``, ``is_multithread_safe``) is subclassed when ``rllm`` is importable, and
:class:`BunshinSandbox` has the sandbox protocol's methods (``exec`` returning stdout and
raising ``CalledProcessError`` on a non-zero exit, as rLLM's local backend does;
``upload_file``, ``upload_dir``, ``close``, ``is_alive``, which never raises).

The group: every env made from the same ``instance_id`` (rLLM's workflows build one env
per rollout from the task's dict) forks from one root: the process's engine, or with
``url`` in the dict the server's group key across processes. An action is a tool call
(``{"name", "arguments"}``, a list of them, or model text with ``<tool_call>`` blocks);
anything without a call ends the episode.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, StateConflict
from ..rollout import Mode, ModeOptions, TaskSpec
from ..tools import ToolCall
from ..workspace.protocol import WorkspaceAPI
from .trajectories import (
    Trajectory,
    as_task,
    client,
    open_trajectory,
    parse_calls,
    row_task,
    safe_id,
)

if TYPE_CHECKING:
    _Base = object
else:
    try:  # a real subclass where rLLM is installed (its workflows look for BaseEnv attributes)
        from rllm.environments.base.base_env import BaseEnv as _Base
    except ImportError:
        _Base = object

#: Folders left out of ``upload_dir`` (rLLM's local backend skips the same kind).
SKIP_DIRS = frozenset({".git", ".venv", "venv", "__pycache__", "node_modules", ".tox", ".mypy_cache", ".pytest_cache"})


class BunshinSandbox:
    """A workspace behind rLLM's ``Sandbox`` protocol. ``close`` removes it (or, for the
    workspace of an env's trajectory, leaves that to the env)."""

    def __init__(self, ws: WorkspaceAPI, *, owned: bool = True, default_timeout: float = 300.0) -> None:
        self._ws = ws
        self._owned = owned
        self._closed = False
        self.default_timeout = default_timeout

    @property
    def workspace(self) -> WorkspaceAPI:
        return self._ws

    def exec(self, command: str, timeout: float | None = None, user: str | None = None) -> str:
        """Run ``command`` with ``sh -c``; its stdout. A non-zero exit raises
        ``subprocess.CalledProcessError`` (with stdout and stderr), a timeout
        ``subprocess.TimeoutExpired``. ``user``: root only (the workspace's root is mapped
        to an unprivileged host id; other users are not set up)."""
        if user not in (None, "root", "0"):
            raise InvalidArgument(f"user {user!r}: bunshin sandboxes run commands as root",
                                  hint="drop the user, or run `su USER -c ...` in the command if the image has one")
        t = timeout or self.default_timeout
        r = self._ws.exec(["sh", "-c", command], timeout=t)
        if r.timed_out:
            raise subprocess.TimeoutExpired(command, t, output=r.stdout, stderr=r.stderr)
        if r.exit_code != 0:
            raise subprocess.CalledProcessError(r.exit_code if r.exit_code is not None else -1, command,
                                                r.stdout, r.stderr)
        return r.stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        """Copy a host file into the workspace (parent folders made, mode kept)."""
        src = Path(local_path)
        if not src.is_file():
            raise InvalidArgument(f"upload_file: {local_path} is not a file", hint="give a regular file's path")
        self._ws.files.write(remote_path, src.read_bytes(), mode=src.stat().st_mode & 0o777)

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        """Copy a host folder into the workspace at ``remote_path`` (replacing what was there),
        without symlinks and the usual heavy folders (``.git``, virtualenvs, caches)."""
        src = Path(local_path)
        if not src.is_dir():
            raise InvalidArgument(f"upload_dir: {local_path} is not a folder", hint="give a folder's path")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
                                     and not os.path.islink(os.path.join(dirpath, d)))
                for name in sorted(filenames):
                    path = Path(dirpath, name)
                    if path.is_file() and not path.is_symlink():
                        tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
        staged = f"/tmp/.bunshin-upload-{os.getpid()}-{id(buf)}.tar"
        self._ws.files.write(staged, buf.getvalue())
        q = _quote(remote_path)
        self.exec(f"rm -rf {q} && mkdir -p {q} && tar -xf {staged} -C {q} --no-same-owner; rc=$?; rm -f {staged}; "
                  "exit $rc")

    def is_alive(self) -> bool:
        """Whether the workspace answers; never raises."""
        if self._closed:
            return False
        try:
            return self._ws.exec(["true"], timeout=10).exit_code == 0
        except Exception:
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._ws.remove()


def _quote(path: str) -> str:
    return "'" + path.replace("'", "'\\''") + "'"


class BunshinEnv(_Base):
    """One rollout of a task at a time; ``reset`` forks it from the instance's root."""

    def __init__(self, task: TaskSpec | Mapping[str, Any], *, instance_id: str | None = None,
                 url: str | None = None, token: str | None = None, token_file: str | None = None,
                 mode: Mode | str = Mode.BUNSHIN, options: ModeOptions | None = None) -> None:
        self.task = task if isinstance(task, TaskSpec) else as_task(task)
        self.instance_id = safe_id(instance_id) if instance_id else self.task.id
        self._url, self._token, self._token_file = url, token, token_file
        self._mode, self._options = mode, options
        self._traj: Trajectory | None = None
        self.turns = 0

    @staticmethod
    def from_dict(info: dict[str, Any]) -> BunshinEnv:
        """From a task row: ``task`` (JSON form) or ``task_file``; optional ``instance_id``,
        ``url``/``token``/``token_file`` (a ``bunshin serve`` host), ``mode``."""
        spec = row_task(info, where="the task dict")
        return BunshinEnv(spec, instance_id=info.get("instance_id"), url=info.get("url"), token=info.get("token"),
                          token_file=info.get("token_file"), mode=info.get("mode", Mode.BUNSHIN))

    @staticmethod
    def is_multithread_safe() -> bool:
        return True  # each env has its own trajectory; the engine they share is thread-safe

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Close the current rollout (if any) and fork a new one from the instance's root."""
        self.close()
        remote = client(self._url, token=self._token, token_file=self._token_file) if self._url else None
        task = self.task if self.task.id == self.instance_id else as_task(self.task, task_id=self.instance_id)
        self._traj = open_trajectory(task, key=self.instance_id, client=remote, mode=self._mode,
                                     options=self._options)
        self.turns = 0
        return {"prompt": self.task.prompt, "messages": self.task.initial_messages()}, \
            {"trajectory_id": self._traj.id, "instance_id": self.instance_id}

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        traj = self._trajectory()
        try:
            calls = _calls_of(action)
        except InvalidArgument as e:
            return {"output": f"error: {e}"}, 0.0, False, {"error": str(e)}
        if not calls:
            return self._done()
        self.turns += 1
        outs = [traj.call(c.name, c.arguments) for c in calls]
        obs = {"output": "\n\n".join(o.text() for o in outs),
               "tool_outputs": [{"name": c.name, "output": o.text(), "cached": o.cached} for c, o in zip(calls, outs,
                                                                                                      strict=True)]}
        if self.turns >= self.task.max_turns:
            _, reward, done, info = self._done()
            return obs, reward, done, {**info, "truncated": True}
        return obs, 0.0, False, {}

    def sandbox(self) -> BunshinSandbox:
        """This rollout's workspace behind rLLM's sandbox protocol (closed with the env)."""
        return BunshinSandbox(self._trajectory().workspace(), owned=False)

    def close(self) -> None:
        traj, self._traj = self._traj, None
        if traj is not None:
            traj.close()

    def _done(self) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        try:
            reward, error = float(self._trajectory().reward() or 0.0), None
        except Exception as e:  # the episode still ends; the trainer sees why it scored 0
            reward, error = 0.0, str(e)
        return {"output": ""}, reward, True, {"reward_error": error}

    def _trajectory(self) -> Trajectory:
        if self._traj is None:
            raise StateConflict("no rollout: reset() first", hint="call env.reset()")
        return self._traj


def _calls_of(action: Any) -> list[ToolCall]:
    if action is None:
        return []
    if isinstance(action, str):
        return parse_calls(action)
    items = action if isinstance(action, list | tuple) else [action]
    calls = []
    for a in items:
        if isinstance(a, ToolCall):
            calls.append(a)
        elif isinstance(a, Mapping) and isinstance(a.get("name"), str):
            calls.append(ToolCall(a["name"], dict(a.get("arguments") or {})))
        else:
            raise InvalidArgument(f"an action is a tool call, a list of them or text, not {str(a)[:80]!r}",
                                  hint='{"name": "bash", "arguments": {"command": "ls"}}')
    return calls
