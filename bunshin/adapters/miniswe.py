"""mini-swe-agent's ``Environment`` on a bunshin workspace (local, or on a ``bunshin serve`` host).

mini-swe-agent takes a dotted import path as its environment class, so no upstream
change is needed::

    environment:
      environment_class: bunshin.adapters.miniswe.BunshinEnvironment
      cwd: /work/proj
      setup: ["python3 -m venv /work/.venv"]
      group: task-17        # every environment of this key forks from one root

It follows mini-swe-agent's own environments (``LocalEnvironment``, ``DockerEnvironment``):
a pydantic config class built from the keyword arguments, ``execute(action, cwd="", *,
timeout=None)`` running ``action["command"]`` in a fresh shell with stderr merged into
stdout and answering ``{"output", "returncode", "exception_info"}`` (a timeout or a failure
of the workspace: ``returncode`` -1, ``exception_info`` and ``extra`` with the exception's
type, as theirs), ``Submitted`` raised when the output's first line is
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, ``get_template_vars()`` and ``serialize()``.

**The group fork.** With ``group`` set, the first environment of the key builds the root
(workspace, ``files``, ``setup``, a copy-on-write snapshot) and every environment of the
key gets a workspace restored from it: setup runs once per group, memory and files are
shared until written. In one process the roots are kept in :data:`._group.GROUPS`
(``release_group(key)`` removes one); with ``url`` set the server's group key does it,
across processes and machines (``POST /v1/groups``). ``BunshinEnvironment.group(n, ...)``
makes the N environments of one group at once. mini-swe-agent is imported lazily.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..config import Config
from ..errors import BunshinError, InvalidArgument, SetupFailed
from ..runtime.state.records import SnapshotMode
from ..workspace import Workspace
from ..workspace.protocol import SnapshotAPI, WorkspaceAPI
from ._group import GROUPS, LocalGroups

log = logging.getLogger("bunshin.adapters.miniswe")
#: The line that ends a mini-swe-agent run (its environments' convention).
SUBMIT_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
#: Runs the interpreter with stderr merged into stdout, in the order written.
_MERGED = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]


class BunshinEnvironmentConfig(BaseModel):
    """What ``BunshinEnvironment(**kwargs)`` takes (mini-swe-agent's config convention).

    ``image``/``memory``/``pids`` size a new workspace; ``files`` (path: text) and ``setup``
    (shell commands, each within ``setup_timeout`` s) prepare it. ``group``: environments of
    one key fork from one root. ``url`` (+ ``token_file`` or ``BUNSHIN_TOKEN``): the
    workspace lives on that ``bunshin serve`` host. ``workspace``: use this existing one
    (not removed by ``close``). ``home``: a bunshin home other than ``BUNSHIN_HOME``.
    """

    model_config = ConfigDict(extra="forbid")

    cwd: str = "/"
    env: dict[str, str] = {}
    timeout: int = 30
    interpreter: list[str] = ["bash", "-c"]
    image: str = "host"
    memory: str = "2G"
    pids: int = 512
    files: dict[str, str] = {}
    setup: list[str] = []
    setup_timeout: float = 600.0
    group: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    url: str | None = None
    token_file: str | None = None
    workspace: str | None = None
    home: str | None = None


class BunshinEnvironment:
    """One mini-swe-agent environment = one bunshin workspace (made on construction,
    as mini-swe-agent's own environments start their container; ``close()`` removes it)."""

    def __init__(self, *, config_class: type = BunshinEnvironmentConfig, groups: LocalGroups | None = None,
                 _workspace: WorkspaceAPI | None = None, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self._groups = groups or GROUPS
        self._client: Any = None
        self._trajectory: Any = None
        self._owned = self.config.workspace is None
        self._uname: dict[str, str] | None = None
        self.ws: WorkspaceAPI = _workspace if _workspace is not None else self._open()
        # mini-swe-agent's own runners never close an environment (its Docker one relies on
        # __del__): what this one holds goes when it is collected or the process exits
        self._finalizer = weakref.finalize(self, _release, self.ws if self._owned else None, self._trajectory,
                                           self._client)

    # --- making the workspace ----------------------------------------------------------

    def _open(self) -> WorkspaceAPI:
        c = self.config
        if c.url is not None:
            from ..client import Client

            self._client = Client(c.url, token_file=c.token_file)
            try:
                return self._open_remote()
            except BaseException:
                self._client.close()
                raise
        cfg = home_config(c)
        if c.workspace is not None:
            return Workspace.get(c.workspace, config=cfg)
        if c.group is None:
            return self._fresh(lambda: Workspace.create(c.image, memory=c.memory, pids=c.pids, config=cfg))
        (ws,) = self._groups.restore(c.group, lambda: root_snapshot(self.config, cfg))
        return ws

    def _open_remote(self) -> WorkspaceAPI:
        c, client = self.config, self._client
        if c.workspace is not None:
            return client.get(c.workspace)
        if c.group is None:
            return self._fresh(lambda: client.create(c.image, memory=c.memory, pids=c.pids))
        task = {"id": c.group, "image": c.image, "memory": c.memory, "pids": c.pids, "files": c.files,
                "setup": [{"run": s, "timeout": c.setup_timeout} for s in c.setup]}
        (traj,) = client.group(key=c.group, n=1, task=task).trajectories
        try:
            ws: WorkspaceAPI = traj.workspace()
        except BaseException:
            traj.close()
            raise
        self._trajectory = traj
        return ws

    def _fresh(self, create: Callable[[], WorkspaceAPI]) -> WorkspaceAPI:
        ws: WorkspaceAPI = create()
        try:
            prepare(ws, self.config)
        except BaseException:
            ws.remove()
            raise
        return ws

    @classmethod
    def group(cls, n: int, **kwargs: Any) -> list[BunshinEnvironment]:
        """The ``n`` environments of one group: one root, ``n`` workspaces restored from it
        in one call (locally; with ``url``, the server's group ``key`` = ``group``). The
        root stays for later groups of the key until ``release_group``."""
        if n < 1:
            raise InvalidArgument(f"a group needs n >= 1, got {n}")
        groups: LocalGroups = kwargs.pop("groups", None) or GROUPS
        config = BunshinEnvironmentConfig(**kwargs)
        if config.group is None:
            raise InvalidArgument("BunshinEnvironment.group needs a group key", hint="pass group='task-id'")
        if config.url is not None or config.workspace is not None:
            return [cls(groups=groups, **kwargs) for _ in range(n)]
        cfg = home_config(config)
        clones = groups.restore(config.group, lambda: root_snapshot(config, cfg), n)
        envs = []
        try:
            for ws in clones:
                envs.append(cls(groups=groups, _workspace=ws, **kwargs))
        except BaseException:
            for ws in clones:
                ws.remove()
            raise
        return envs

    # --- mini-swe-agent's Environment protocol -----------------------------------------

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in a fresh shell in ``cwd`` (default the config's)."""
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            r = self.ws.commands.run([*_MERGED, *self.config.interpreter, command], timeout=limit,
                                     cwd=cwd or self.config.cwd, env=self.config.env or None)
        except BunshinError as e:
            output = _failure("", e)
        else:
            if r.timed_out:
                why = f"Command {command!r} timed out after {limit} seconds"
                output = _failure(r.stdout, why, "TimeoutExpired")
            else:
                output = {"output": r.stdout, "returncode": r.exit_code, "exception_info": ""}
        _check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        from minisweagent.utils.serialize import recursive_merge

        return recursive_merge(self.config.model_dump(), self.uname(), kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{type(self).__module__}.{type(self).__name__}",
            "workspace": self.ws.id,
        }}}

    # --- bunshin's side ----------------------------------------------------------------

    def uname(self) -> dict[str, str]:
        """``platform.uname()``'s fields as seen inside the workspace (mini-swe-agent's
        templates show them to the model)."""
        if self._uname is None:
            keys = ("system", "node", "release", "version", "machine")
            r = self.ws.exec("for f in -s -n -r -v -m; do uname $f; done", timeout=30)
            lines = r.stdout.splitlines() if r.ok else []
            self._uname = dict(zip(keys, lines + [""] * (len(keys) - len(lines)), strict=True))
        return self._uname

    def close(self) -> None:
        """Remove the workspace (not one given by ``workspace``); twice is a no-op. One never
        closed is removed when the environment is collected, or at the latest when the
        process exits."""
        self._finalizer.detach()
        try:
            if self._trajectory is not None:
                self._trajectory.close()
            elif self._owned:
                self.ws.remove()
        finally:
            self._owned, self._trajectory = False, None
            if self._client is not None:
                self._client.close()
                self._client = None

    cleanup = close  # the name mini-swe-agent's own environments use

    def __enter__(self) -> BunshinEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def home_config(config: BunshinEnvironmentConfig) -> Config:
    """The bunshin config of ``config.home`` (default: ``BUNSHIN_HOME``'s)."""
    env = Config.from_env()
    return Config.for_home(Path(config.home), criu=env.criu) if config.home else env


def prepare(ws: WorkspaceAPI, config: BunshinEnvironmentConfig) -> None:
    """Write ``config.files`` and run ``config.setup`` in ``ws``; ``SetupFailed`` naming the
    step that failed."""
    for path, text in config.files.items():
        ws.files.write(path, text)
    for step in config.setup:
        r = ws.exec(["/bin/sh", "-c", step], timeout=config.setup_timeout, cwd="/")
        if not r.ok:
            why = "timed out" if r.timed_out else f"exited {r.exit_code}"
            raise SetupFailed(f"setup step {step!r} {why}: {(r.stderr or r.stdout)[-2000:]}",
                              hint="fix the step, or run it by hand in a workspace to see why")


def root_snapshot(config: BunshinEnvironmentConfig, cfg: Config) -> SnapshotAPI:
    """A group's root: a workspace prepared once and snapshotted copy-on-write (the
    workspace itself is removed; the snapshot is kept until released)."""
    with Workspace.create(config.image, memory=config.memory, pids=config.pids, config=cfg) as ws:
        prepare(ws, config)
        return ws.snapshot(mode=SnapshotMode.COW)


def release_group(key: str, *, url: str | None = None, token_file: str | None = None,
                  groups: LocalGroups | None = None) -> bool:
    """Free the root of group ``key``: this process's (locally), or the server's (``url``)."""
    if url is None:
        return (groups or GROUPS).release(key)
    from ..client import Client

    with Client(url, token_file=token_file) as client:
        client.request("DELETE", f"/v1/groups/{key}", default_wait=False)
    return True


def _release(ws: WorkspaceAPI | None, trajectory: Any, client: Any) -> None:
    """What an environment nobody closed holds, freed (at collection or exit: no errors raised)."""
    try:
        if trajectory is not None:
            trajectory.close()
        elif ws is not None:
            ws.remove()
    except Exception as e:  # the process is going; gc finishes the job
        log.warning("removing an unclosed mini-swe-agent environment's workspace failed: %s", e)
    finally:
        if client is not None:
            client.close()


def _failure(output: str, error: BunshinError | str, kind: str | None = None) -> dict[str, Any]:
    """The shape mini-swe-agent's environments give a command that raised."""
    return {"output": output, "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {error}",
            "extra": {"exception_type": kind or type(error).__name__, "exception": str(error)}}


def _check_finished(output: dict[str, Any]) -> None:
    """Raise mini-swe-agent's ``Submitted`` if the command printed the submit line first."""
    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_LINE and output["returncode"] == 0:
        from minisweagent.exceptions import Submitted

        submission = "".join(lines[1:])
        raise Submitted({"role": "exit", "content": submission,
                         "extra": {"exit_status": "Submitted", "submission": submission}})


__all__ = ["BunshinEnvironment", "BunshinEnvironmentConfig", "prepare", "release_group", "root_snapshot"]
