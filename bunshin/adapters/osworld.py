"""OSWorld's ``DesktopEnv`` shape on bunshin desktops: ``reset(task_config)`` restores the
task's snapshot instead of reverting a VM.

::

    from bunshin.adapters.osworld import DesktopEnv
    env = DesktopEnv(action_space="computer_13")
    obs = env.reset(task_config)      # first time: boot the desktop, run the task's setup, snapshot it
    obs, reward, done, info = env.step({"action_type": "CLICK", "parameters": {"x": 60, "y": 40}})
    score = env.evaluate()            # the task's evaluator, in the workspace as it is now
    env.close()

A task config is OSWorld's JSON: ``id``, ``instruction``, ``config`` (setup steps:
``launch``/``execute``/``command`` with ``command`` and ``shell``, ``sleep`` with
``seconds``, ``open`` with ``path``, ``activate_window``/``close_window`` with
``window_name``, ``upload_file`` with ``files: [{local_path, path}]``) and ``evaluator``
(:mod:`bunshin.adapters.osworld_eval`). The first reset of a task boots a desktop, runs
the setup and snapshots the workspace (``cow``: memory and files shared copy-on-write);
every reset of it (the same env or a second env given the same ``roots``) restores that
snapshot in a fraction of a second, with the apps open as setup left them. An
observation is ``{"screenshot": PNG bytes, "accessibility_tree": None, "terminal": None,
"instruction": ...}`` (no AT-SPI here). The OSWorld server contract
(:mod:`bunshin_agent.osworld`) runs on the workspace's loopback :5000 when
``osworld_server=True``, for OSWorld's own controllers.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import InvalidArgument, StateConflict
from ..runtime.state.records import SnapshotMode
from ..workspace import LocalHost
from ..workspace.desktop import Desktop, DesktopSpec
from ..workspace.protocol import HostAPI, SnapshotAPI, WorkspaceAPI
from . import osworld_actions, osworld_eval

ACTION_SPACES = ("computer_13", "pyautogui")
SETUP_TYPES = ("launch", "execute", "command", "sleep", "open", "activate_window", "close_window", "upload_file")


def root_key(task_config: Mapping[str, Any], desktop: DesktopSpec) -> str:
    """A task's snapshot key: its id, setup and screen (not its instruction or evaluator)."""
    parts = {"id": task_config.get("id"), "config": task_config.get("config", []), "desktop": desktop.to_dict()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def setup(desk: Desktop, steps: Any) -> None:
    """Run OSWorld setup steps on a fresh desktop; a bad step raises ``InvalidArgument``."""
    if not isinstance(steps, list):
        raise InvalidArgument("task config: 'config' must be a list of setup steps")
    for i, step in enumerate(steps):
        kind = step.get("type") if isinstance(step, Mapping) else None
        p = step.get("parameters", {}) if isinstance(step, Mapping) else {}
        if kind not in SETUP_TYPES:
            raise InvalidArgument(f"task config step {i}: setup type {kind!r} is not supported here",
                                  hint=f"one of {', '.join(SETUP_TYPES)}")
        if kind == "sleep":
            time.sleep(float(p.get("seconds", 1)))
        elif kind in ("launch", "execute", "command"):
            cmd = p.get("command") or []
            if p.get("shell"):
                argv = ["sh", "-c", cmd if isinstance(cmd, str) else " ".join(shlex.quote(str(a)) for a in cmd)]
            else:
                argv = shlex.split(cmd) if isinstance(cmd, str) else [str(a) for a in cmd]
            if not argv:
                raise InvalidArgument(f"task config step {i}: {kind} without a command")
            if kind == "launch":
                desk.launch(argv)
            else:
                r = desk.ws.exec(argv, env=desk.spec.env, timeout=float(p.get("timeout", 120)))
                if r.exit_code != 0:
                    raise InvalidArgument(f"task config step {i}: {argv} exited {r.exit_code}: {r.stderr[-500:]}")
        elif kind == "open":
            desk.open(str(p.get("path", "")))
        elif kind in ("activate_window", "close_window"):
            wid = desk.xdotool("search", "--onlyvisible", "--name", str(p.get("window_name", "")), check=False).split()
            if not wid:
                raise InvalidArgument(f"task config step {i}: no window named {p.get('window_name')!r}")
            desk.xdotool("windowactivate" if kind == "activate_window" else "windowclose", wid[0])
        elif kind == "upload_file":
            for f in p.get("files", []):
                desk.ws.files.write(str(f["path"]), Path(f["local_path"]).read_bytes())


class DesktopEnv:
    """One OSWorld-style episode at a time on a bunshin desktop (see the module docstring).

    ``roots``: task snapshots shared between envs (key: ``root_key``); the env frees only
    the roots it made, at ``close``.
    """

    def __init__(self, *, action_space: str = "computer_13", desktop: DesktopSpec | bool | str = True,
                 image: str = "host", memory: str = "2G", host: HostAPI | None = None,
                 config: Config | None = None, osworld_server: bool = False,
                 roots: dict[str, SnapshotAPI] | None = None) -> None:
        if action_space not in ACTION_SPACES:
            raise InvalidArgument(f"action_space {action_space!r}", hint=f"one of {', '.join(ACTION_SPACES)}")
        spec = DesktopSpec.parse(desktop)
        if spec is None:
            raise InvalidArgument("a DesktopEnv needs a desktop", hint="desktop=True or '1280x800'")
        self.action_space = action_space
        self.desktop_spec = spec
        self.image, self.memory = image, memory
        self.host: HostAPI = host if host is not None else LocalHost(config or Config.from_env())
        self.osworld_server = osworld_server
        self.roots: dict[str, SnapshotAPI] = {} if roots is None else roots
        self._own_roots: list[str] = []
        self.ws: WorkspaceAPI | None = None
        self.task: dict[str, Any] = {}
        self.last_action: str | None = None
        self.timings: dict[str, float] = {}

    # --- episodes -------------------------------------------------------------------

    def reset(self, task_config: Mapping[str, Any] | None = None, seed: int | None = None,
              options: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Start the task from its snapshot (made on its first reset); its first observation."""
        task = dict(task_config if task_config is not None else self.task)
        if not task:
            raise InvalidArgument("reset needs a task config the first time", hint="env.reset(task_config)")
        if "evaluator" in task:
            osworld_eval.check(task["evaluator"])
        self._release()
        key = root_key(task, self.desktop_spec)
        t0 = time.perf_counter()
        if key not in self.roots:
            self.roots[key] = self._build_root(task)
            self._own_roots.append(key)
            self.timings["build_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        (self.ws,) = self.roots[key].restore(1)
        self.timings["restore_s"] = time.perf_counter() - t1
        self.task, self.last_action = task, None
        return self._observe()

    def _build_root(self, task: Mapping[str, Any]) -> SnapshotAPI:
        ws = self.host.create(self.image, memory=self.memory)
        try:
            desk = Desktop.start(ws, self.desktop_spec)
            if self.osworld_server:
                desk.start_osworld()
            setup(desk, task.get("config", []))
            time.sleep(0.3)  # the last app's first paint
            return ws.snapshot(mode=SnapshotMode.COW)
        finally:
            ws.remove()

    def step(self, action: Any, pause: float = 0.5) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        """Do one action; ``(observation, reward, done, info)``. The reward is 0 (OSWorld scores
        with ``evaluate``); ``done`` after ``DONE`` or ``FAIL``; a bad action is not done, its
        error is in ``info["error"]`` and nothing happened."""
        desk = self._desktop()
        info: dict[str, Any] = {}
        try:
            if self.action_space == "computer_13":
                if isinstance(action, str) and action in osworld_actions.CONTROL:
                    action = {"action_type": action}
                if not isinstance(action, Mapping):
                    raise InvalidArgument(f"a computer_13 action is an object, not {type(action).__name__}")
                kind = osworld_actions.computer_13(desk, action)
            else:
                if not isinstance(action, str):
                    raise InvalidArgument(f"a pyautogui action is code (a string), not {type(action).__name__}")
                kind, info["output"] = osworld_actions.pyautogui(desk, action)
        except InvalidArgument as exc:
            info["error"] = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
            kind = "ERROR"
        else:
            self.last_action = kind
        if kind not in osworld_actions.CONTROL and kind != "ERROR":
            time.sleep(pause)
        return self._observe(), 0.0, kind in ("DONE", "FAIL"), info

    def evaluate(self) -> float:
        """The task's evaluator in the current workspace (0 or 1, or in between)."""
        if "evaluator" not in self.task:
            raise InvalidArgument("the task has no evaluator", hint="add an 'evaluator' block to the task config")
        return osworld_eval.evaluate(self._desktop(), self.task["evaluator"], self.last_action)

    def close(self) -> None:
        """Remove the episode's workspace and the task snapshots this env made."""
        self._release()
        for key in self._own_roots:
            root = self.roots.pop(key, None)
            if root is not None:
                root.remove()
        self._own_roots.clear()

    def __enter__(self) -> DesktopEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------

    def _desktop(self) -> Desktop:
        if self.ws is None:
            raise StateConflict("no episode: reset first", hint="env.reset(task_config)")
        return Desktop.of(self.ws)

    def _observe(self) -> dict[str, Any]:
        return {"screenshot": self._desktop().screenshot(), "accessibility_tree": None, "terminal": None,
                "instruction": self.task.get("instruction", "")}

    def _release(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            ws.remove()
