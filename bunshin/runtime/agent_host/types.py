"""Typed results of the in-workspace agent's operations (see ``agent_client``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AnyStr, Generic

from ...agent.wire import FileType as FileType  # the wire's entry types: file, dir, symlink, other


@dataclass(frozen=True)
class AgentInfo:
    """What ``ping`` answers. ``identity`` is what ``identify`` stored ({} at first)."""

    pid: int
    version: str
    uptime_s: float
    identity: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ExecResult(Generic[AnyStr]):
    """A finished command. On timeout the whole process group was SIGKILLed.

    ``exit_code`` is the exit status (0-255), or minus the signal number that killed it
    (``signal`` then holds that number; as ``subprocess.Popen.returncode``): a command
    killed at its timeout has ``-9`` and ``timed_out``. This is the one meaning of
    ``exit_code`` across bunshin (``SessionResult``, ``Observation``: ``None`` where
    there is no status; the CLI exits ``128 + N`` for signal N, as a shell does). Truncated streams end with a note
    saying how many bytes were dropped. With ``text=False`` the streams are the
    exact bytes (no note: the ``*_truncated`` flags say it): ``ExecResult[bytes]``.
    """

    exit_code: int
    signal: int | None
    stdout: AnyStr
    stderr: AnyStr
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class SessionResult:
    """One command run in a persistent shell session.

    ``exit_code`` is ``None`` when the command timed out (it was interrupted;
    the session lives on) and the shell's own status if the command ended the
    shell (``alive`` is then false).
    """

    output: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    alive: bool = True


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    kind: str
    pid: int
    busy: bool
    alive: bool


@dataclass(frozen=True)
class FileEntry:
    """A directory entry or a ``stat`` result (symlinks are not followed)."""

    name: str
    type: FileType
    size: int
    mode: int
    mtime: float
    link_target: str | None = None


@dataclass(frozen=True)
class ProcessInfo:
    """A process in the workspace's pid namespace, as ``/proc`` shows it."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    name: str
    cmdline: tuple[str, ...]
