"""The workspace and snapshot protocols: what every layer above the runtime is typed against.

Three implementations satisfy them: the local one (:class:`bunshin.Workspace`,
:class:`bunshin.Snapshot`, over the runtime on this host), the remote one (over HTTP)
and the fake one (:mod:`bunshin.testing`, in memory). Tools, the prefix cache,
speculation and the rollout engine use only what is written here, so they run the
same against each; none of them touches the runtime's agent client.

The protocols are blocking; :class:`bunshin.AsyncWorkspace` is the one async adapter
over any of them. Features hang off sub-objects (``ws.commands``, ``ws.files``,
``ws.sessions``)::

    ws.exec("make test", timeout=60)            # = ws.commands.run(...)
    sid = ws.sessions.open("bash", cwd="/w")
    ws.sessions.run(sid, "cd src; export X=1")
    (clone,) = ws.fork(1)                      # continues from this instant
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, overload, runtime_checkable

from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container.stats import WorkspaceStats
from ..runtime.state.records import SnapshotMode

Command = str | Sequence[str]
"""A shell string (run by ``/bin/sh -c``) or an argv list (run as it is)."""


@runtime_checkable
class CommandsAPI(Protocol):
    """One-shot commands: ``ws.commands.run("make test", timeout=60)``."""

    @overload
    def run(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        max_output: int | None = None,
        text: Literal[True] = True,
    ) -> ExecResult[str]: ...

    @overload
    def run(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        max_output: int | None = None,
        text: Literal[False],
    ) -> ExecResult[bytes]: ...

    @overload
    def run(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        max_output: int | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]: ...

    def run(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        max_output: int | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]:
        """Run and wait. ``text=False``: ``stdout``/``stderr`` as the exact bytes written."""
        ...

    def spawn(self, command: Command, *, cwd: str | None = None,
              env: dict[str, str] | None = None) -> int:
        """Start a long-lived background process; its pid inside the workspace."""
        ...


@runtime_checkable
class FilesAPI(Protocol):
    """Files inside the workspace."""

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """The file's bytes from ``offset``: at most ``length``, else up to its end (a file
        over ``MAX_FILE_BYTES`` is refused: read it in parts)."""
        ...

    def read_text(self, path: str) -> str: ...

    def write(self, path: str, data: bytes | str, *, mode: int | None = None) -> int:
        """Write ``data`` (parent folders made); the number of bytes written."""
        ...

    def list(self, path: str = "/") -> list[FileEntry]: ...

    def remove(self, path: str, *, recursive: bool = False) -> None: ...


@runtime_checkable
class SessionsAPI(Protocol):
    """Persistent shells: cwd, variables, functions and history carry across runs.

    Sessions are part of the workspace's state: a fork's clones have them too, in the
    state they were in at the fork.
    """

    def list(self) -> list[SessionInfo]: ...

    def open(self, kind: str = "bash", *, cwd: str | None = None,
             env: dict[str, str] | None = None) -> str:
        """A new session; its id."""
        ...

    def run(self, session_id: str, command: str, *, timeout: float | None = None,
            max_output: int | None = None) -> SessionResult:
        """Run ``command`` in the session; a timeout interrupts the command, not the session."""
        ...

    def close(self, session_id: str) -> None: ...


@runtime_checkable
class SnapshotAPI(Protocol):
    """A captured workspace state; restore it any number of times."""

    @property
    def id(self) -> str: ...

    @property
    def size_bytes(self) -> int:
        """What it holds: memory files, images and its file layer."""
        ...

    def restore(self, n: int = 1) -> Sequence[WorkspaceAPI]:
        """``n`` new running workspaces in this state; all of them or none."""
        ...

    def remove(self) -> None: ...


@runtime_checkable
class WorkspaceAPI(Protocol):
    """One isolated, stateful workspace."""

    @property
    def id(self) -> str: ...

    @property
    def commands(self) -> CommandsAPI: ...

    @property
    def files(self) -> FilesAPI: ...

    @property
    def sessions(self) -> SessionsAPI: ...

    @overload
    def exec(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: Literal[True] = True,
    ) -> ExecResult[str]: ...

    @overload
    def exec(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: Literal[False],
    ) -> ExecResult[bytes]: ...

    @overload
    def exec(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]: ...

    def exec(
        self,
        command: Command,
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]:
        """``commands.run`` without ``max_output``."""
        ...

    def processes(self) -> list[ProcessInfo]: ...

    def stats(self) -> WorkspaceStats: ...

    def set_cpu_priority(self, nice: int) -> None:
        """The whole workspace's CPU priority as a nice value 0..19."""
        ...

    def is_alive(self) -> bool: ...

    def snapshot(self, *, mode: SnapshotMode | str = SnapshotMode.COW) -> SnapshotAPI:
        """Capture it while it keeps running; kept until removed."""
        ...

    def fork(self, n: int = 1, *, mode: SnapshotMode | str = SnapshotMode.COW) -> Sequence[WorkspaceAPI]:
        """``n`` live clones continuing from this instant; all of them or none."""
        ...

    def remove(self) -> None:
        """Kill every process and free everything it holds."""
        ...


@runtime_checkable
class HostAPI(Protocol):
    """Where workspaces are made: this machine (:class:`bunshin.workspace.LocalHost`) or a
    ``bunshin serve`` host (:class:`bunshin.client.Client`)."""

    def create(self, image: str = "host", *, name: str | None = None, memory: str | int | None = "2G",
               pids: int | None = 512) -> WorkspaceAPI:
        """A new workspace from ``image``, with a memory and a process limit."""
        ...
