"""Typed requests and responses of the HTTP API (pydantic), shared by server and client.

Records of the layers below (``ExecResult``, ``SessionResult``, ``FileEntry``...) cross
the wire as these models and are rebuilt as the same records on the client, so a
remote workspace answers exactly what a local one does. Bytes travel as base64
(``ExecOut.encoding``); errors as :class:`ErrorOut` (bunshin's code, message, hint and
details, rebuilt as the same exception class by ``BunshinError.from_dict``).
"""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import InvalidArgument
from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    FileType,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container.stats import MemoryStats, WorkspaceStats
from ..runtime.kernel.limits import MAX_OUTPUT, MAX_TIMEOUT_S
from ..runtime.net.policy import NetworkMode, Policy
from ..runtime.oci.refs import looks_like_ref
from ..runtime.state.budget import MIN_PIDS, PID_MAX_LIMIT
from ..runtime.state.records import SnapshotMode
from ..workspace.forks import ForkTimings

API_VERSION = "v1"
#: Most workspaces one create or restore call makes (the runtime's own batch cap).
MAX_COUNT = 1024
#: Longest workspace lease: 30 days.
MAX_TTL_S = 30 * 24 * 3600.0
TTL = Annotated[float | None, Field(gt=0, le=MAX_TTL_S,
                                    description="seconds until the server removes the workspace, unless renewed")]


def served_image(image: str) -> str:
    """``image`` if a remote caller may name it: 'host' or an image reference, never a host
    folder (absolute, relative, or a name that is not a reference); else ``ValueError``."""
    if image != "host" and (image.startswith(("/", ".", "~")) or not looks_like_ref(image)):
        raise ValueError(f"{image!r} is not an image reference (host folders are not served): give 'host', "
                         "or an image reference the host holds or can pull (`bunshin image ls` on the host)")
    return image


#: An image a remote caller names (:func:`served_image`).
ServedImage = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(served_image)]


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


M = TypeVar("M", bound=Model)


def build(model: type[M], **fields: Any) -> M:
    """A request made on the client, checked as the server will check it: bad input is
    :class:`InvalidArgument` before anything is sent."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}"
                             for e in exc.errors())
        raise InvalidArgument(f"invalid {model.__name__}: {problems}") from None


class ErrorOut(Model):
    code: str
    message: str
    hint: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class Health(Model):
    ok: bool
    version: str
    api: str = API_VERSION


# --- workspaces ----------------------------------------------------------------------


class PublishPort(Model):
    """A workspace ``port`` published on the server host's loopback at ``host_port``
    (None: a free one). Over HTTP only loopback: a client cannot open the server host's
    other addresses."""

    port: int = Field(ge=1, le=65535)
    host_port: int | None = Field(default=None, ge=1024, le=65535,
                                  description="1024 or above: a client never takes a privileged port of the server host")


class PortOut(Model):
    port: int
    host: str
    host_port: int


#: Most allow (and deny) rules one request may carry.
MAX_RULES = 256


def _rules_ok(allow: list[str], deny: list[str]) -> None:
    """Each rule a CIDR, an address, a name or ``*.domain`` (``runtime.net.policy``)."""
    try:
        Policy.of(allow, deny)
    except InvalidArgument as e:
        raise ValueError(e.message) from None


class NetworkPolicyIn(Model):
    """A workspace's whole egress policy: ``allow`` and ``deny`` rules (CIDRs, addresses,
    domain names, ``*.domain``)."""

    allow: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    deny: list[str] = Field(default_factory=list, max_length=MAX_RULES)

    @model_validator(mode="after")
    def _rules(self) -> NetworkPolicyIn:
        _rules_ok(self.allow, self.deny)
        return self


class NetworkOut(Model):
    network: str  # none | egress
    address: str | None = None  # its IPv4 address on its link out (egress)
    allow: list[str] = []
    deny: list[str] = []


class CreateWorkspace(Model):
    """``image``: ``host`` or an image reference the host holds or can pull (over HTTP a host
    folder is never an image: that is a local choice). ``publish``: ports published on
    each new workspace (with ``count`` > 1, no fixed ``host_port``)."""

    image: ServedImage = "host"
    name: str | None = Field(default=None, max_length=64)
    memory: str | int | None = "2G"
    pids: int | None = Field(default=512, ge=MIN_PIDS, le=PID_MAX_LIMIT)
    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    ttl: TTL = None
    publish: list[PublishPort] = Field(default_factory=list, max_length=16)
    # none: loopback only; egress: NAT out under allow/deny; None: the server's default
    network: NetworkMode | None = None
    allow: list[str] = Field(default_factory=list, max_length=MAX_RULES)
    deny: list[str] = Field(default_factory=list, max_length=MAX_RULES)

    @model_validator(mode="after")
    def _one_host_port_each(self) -> CreateWorkspace:
        if self.count > 1 and any(p.host_port is not None for p in self.publish):
            raise ValueError("publish: with count > 1 leave host_port out (each workspace gets a free one)")
        if (self.allow or self.deny) and self.network == NetworkMode.NONE:
            raise ValueError("allow/deny rules need network 'egress'")
        _rules_ok(self.allow, self.deny)
        return self


class WorkspaceOut(Model):
    id: str
    name: str | None
    image: str
    state: str
    pid: int | None
    created_at: float
    parent: str | None
    memory_limit: int | None
    pids_limit: int | None
    expires_at: float | None = None  # its lease: the server removes it then, unless renewed
    ports: list[PortOut] | None = None  # published on create (``publish``)


class ForkRequest(Model):
    """``ttl``: the clones' lease; none given, each clone gets its parent's (if it has one)."""

    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    mode: SnapshotMode = SnapshotMode.COW
    ttl: TTL = None


class SetTTL(Model):
    """A new lease from now (``null``: none, the workspace lives until removed)."""

    ttl: TTL


class ForkOut(Model):
    """One entry per fork: all of them or none (a failed fork is an error, nothing made).
    The fork's timings (as ``ForkTimings``): the parent's pause, the dump, the memory-file
    rewrite, the memory files written, each fork's restore (in ``forks``' order)."""

    parent: str
    snapshot: str | None
    pause_ms: float | None
    forks: list[WorkspaceOut]
    mode: SnapshotMode | None = None
    dump_ms: float | None = None
    rewrite_ms: float | None = None
    memfile_bytes: int | None = None
    restore_ms: list[float | None] | None = None

    def timings(self) -> ForkTimings | None:
        """The timings as :class:`~bunshin.workspace.forks.ForkTimings` (``None`` from a
        server too old to send them)."""
        if None in (self.snapshot, self.mode, self.pause_ms, self.dump_ms, self.rewrite_ms, self.memfile_bytes,
                    self.restore_ms):
            return None
        assert self.snapshot is not None and self.mode is not None and self.pause_ms is not None
        assert self.dump_ms is not None and self.rewrite_ms is not None and self.memfile_bytes is not None
        return ForkTimings(self.snapshot, self.mode, self.pause_ms, self.dump_ms, self.rewrite_ms,
                           self.memfile_bytes, tuple(self.restore_ms or ()))


class Priority(Model):
    nice: int = Field(ge=0, le=19)


# --- commands and sessions -----------------------------------------------------------


class ExecRequest(Model):
    command: str | list[str] = Field(min_length=1)
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    max_output: int | None = Field(default=None, ge=0, le=MAX_OUTPUT)
    text: bool = True


class ExecOut(Model):
    exit_code: int
    signal: int | None
    stdout: str
    stderr: str
    encoding: Literal["utf-8", "base64"] = "utf-8"
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    duration_s: float

    @classmethod
    def of(cls, r: ExecResult[str] | ExecResult[bytes]) -> ExecOut:
        if isinstance(r.stdout, bytes) and isinstance(r.stderr, bytes):
            out, err, encoding = base64.b64encode(r.stdout).decode(), base64.b64encode(r.stderr).decode(), "base64"
        else:
            assert isinstance(r.stdout, str) and isinstance(r.stderr, str)
            out, err, encoding = r.stdout, r.stderr, "utf-8"
        return cls(exit_code=r.exit_code, signal=r.signal, stdout=out, stderr=err,
                   encoding="base64" if encoding == "base64" else "utf-8",
                   stdout_truncated=r.stdout_truncated, stderr_truncated=r.stderr_truncated,
                   timed_out=r.timed_out, duration_s=r.duration_s)

    def text_result(self) -> ExecResult[str]:
        return ExecResult[str](self.exit_code, self.signal, self.stdout, self.stderr, self.stdout_truncated,
                               self.stderr_truncated, self.timed_out, self.duration_s)

    def bytes_result(self) -> ExecResult[bytes]:
        return ExecResult[bytes](self.exit_code, self.signal, base64.b64decode(self.stdout),
                                 base64.b64decode(self.stderr), self.stdout_truncated,
                                 self.stderr_truncated, self.timed_out, self.duration_s)


class SpawnRequest(Model):
    command: str | list[str] = Field(min_length=1)
    cwd: str | None = None
    env: dict[str, str] | None = None


class SpawnOut(Model):
    pid: int


class OpenSession(Model):
    kind: Literal["bash", "sh"] = "bash"
    cwd: str | None = None
    env: dict[str, str] | None = None


class SessionOut(Model):
    session_id: str
    kind: str
    pid: int
    busy: bool
    alive: bool

    @classmethod
    def of(cls, s: SessionInfo) -> SessionOut:
        return cls(session_id=s.session_id, kind=s.kind, pid=s.pid, busy=s.busy, alive=s.alive)

    def record(self) -> SessionInfo:
        return SessionInfo(self.session_id, self.kind, self.pid, self.busy, self.alive)


class OpenedSession(Model):
    session_id: str


class RunInSession(Model):
    command: str
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    max_output: int | None = Field(default=None, ge=0, le=MAX_OUTPUT)


class SessionRunOut(Model):
    output: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    duration_s: float
    alive: bool

    @classmethod
    def of(cls, r: SessionResult) -> SessionRunOut:
        return cls(output=r.output, exit_code=r.exit_code, timed_out=r.timed_out, truncated=r.truncated,
                   duration_s=r.duration_s, alive=r.alive)

    def record(self) -> SessionResult:
        return SessionResult(self.output, self.exit_code, self.timed_out, self.truncated, self.duration_s,
                             self.alive)


# --- files, processes, stats ---------------------------------------------------------


class FileOut(Model):
    name: str
    type: FileType
    size: int
    mode: int
    mtime: float
    link_target: str | None = None

    @classmethod
    def of(cls, e: FileEntry) -> FileOut:
        return cls(name=e.name, type=e.type, size=e.size, mode=e.mode, mtime=e.mtime, link_target=e.link_target)

    def record(self) -> FileEntry:
        return FileEntry(self.name, self.type, self.size, self.mode, self.mtime, self.link_target)


class Written(Model):
    bytes: int


class ProcessOut(Model):
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    name: str
    cmdline: list[str]

    @classmethod
    def of(cls, p: ProcessInfo) -> ProcessOut:
        return cls(pid=p.pid, ppid=p.ppid, pgid=p.pgid, sid=p.sid, state=p.state, name=p.name,
                   cmdline=list(p.cmdline))

    def record(self) -> ProcessInfo:
        return ProcessInfo(self.pid, self.ppid, self.pgid, self.sid, self.state, self.name, tuple(self.cmdline))


class StatsOut(Model):
    id: str
    cgroup_bytes: int
    pss_bytes: int
    uss_bytes: int
    anon_bytes: int
    processes: int
    cpu_s: float

    @classmethod
    def of(cls, s: WorkspaceStats) -> StatsOut:
        m = s.memory
        return cls(id=s.id, cgroup_bytes=m.cgroup_bytes, pss_bytes=m.pss_bytes, uss_bytes=m.uss_bytes,
                   anon_bytes=m.anon_bytes, processes=s.processes, cpu_s=s.cpu_s)

    def record(self) -> WorkspaceStats:
        return WorkspaceStats(self.id, MemoryStats(self.cgroup_bytes, self.pss_bytes, self.uss_bytes,
                                                   self.anon_bytes), self.processes, self.cpu_s)


# --- snapshots -----------------------------------------------------------------------


class TakeSnapshot(Model):
    mode: SnapshotMode = SnapshotMode.COW


class SnapshotOut(Model):
    id: str
    source: str
    mode: SnapshotMode
    created_at: float
    depth: int
    pause_ms: float
    size_bytes: int


class RestoreRequest(Model):
    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    ttl: TTL = None
