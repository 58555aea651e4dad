"""The Workspace object: one isolated, stateful container an agent's tools run in.

Features hang off sub-objects: ``ws.commands`` (one-shot commands), ``ws.files``,
``ws.sessions`` (persistent shells on a pty; ``ws.shell()`` wraps one in an object).
Creation is a classmethod: constructing a ``Workspace`` object does no I/O;
``Workspace.create`` starts a container. ``Workspace`` and ``Snapshot`` are the local
implementation of the protocols in :mod:`bunshin.workspace.protocol`.
"""

from __future__ import annotations

import builtins
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

from ..config import Config
from ..errors import StateConflict
from ..runtime import snapshot as rsnap
from ..runtime.agent_host.client import AgentClient
from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container import lifecycle as container
from ..runtime.container import port_socket
from ..runtime.container import publish as rpublish
from ..runtime.container import stats as rstats
from ..runtime.container.cgroups import WorkspaceCgroup
from ..runtime.container.publish import Published
from ..runtime.container.stats import WorkspaceStats
from ..runtime.kernel.limits import check_timeout, exec_timeout
from ..runtime.net import attach as rnet
from ..runtime.net.policy import Limits, NetworkMode, Policy
from ..runtime.snapshot import folder_load, folder_save
from ..runtime.state.records import Mount, SnapshotMode, WorkspaceRecord, WorkspaceState
from ..runtime.state.store import Store
from .desktop import Desktop, DesktopSpec
from .forks import ForkResult, ForkTimings
from .protocol import SnapshotAPI, WorkspaceAPI


@dataclass(frozen=True)
class WorkspaceInfo:
    """What ``bunshin ls`` shows of a workspace."""

    id: str
    name: str | None
    image: str
    state: str
    pid: int | None
    created_at: float
    parent: str | None
    memory_limit: int | None
    pids_limit: int | None

    @classmethod
    def of(cls, rec: WorkspaceRecord) -> WorkspaceInfo:
        """What ``ls`` shows of ``rec`` (a running record whose processes are gone reads ``dead``)."""
        state = rec.state
        if state == WorkspaceState.RUNNING and not container.is_alive(rec):
            state = WorkspaceState.DEAD
        return cls(rec.id, rec.name, rec.image, state.value, rec.pid, rec.created_at, rec.parent,
                   rec.memory_limit, rec.pids_limit)


class Workspace:
    """A live workspace. Get one with :meth:`create` or :meth:`get`."""

    def __init__(self, config: Config, record: WorkspaceRecord) -> None:
        self._config = config
        self._record = record
        self.commands = Commands(self)
        self.files = Files(self)
        self.sessions = Sessions(self)
        self.last_fork: rsnap.SnapshotRecord | None = None

    # lifecycle -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        image: str = "host",
        *,
        name: str | None = None,
        memory: str | int | None = "2G",
        pids: int | None = 512,
        command: Sequence[str] | None = None,
        config: Config | None = None,
        mounts: Sequence[Mount | str] = (),
        desktop: DesktopSpec | bool | str | None = None,
        network: NetworkMode | str = NetworkMode.NONE,
        allow: Sequence[str] = (),
        deny: Sequence[str] = (),
        limits: Limits | None = None,
    ) -> Workspace:
        """Start a new workspace from ``image``: 'host', a root filesystem folder, or an
        OCI/Docker image in the store (``name:tag``, an id; a reference naming its registry,
        ``localhost:5000/team/env:v1``, is pulled on first use). An image's Env, WorkingDir
        and User hold for every command; ``command`` runs as ``docker run IMAGE [command]``
        (its Entrypoint, then ``command`` or its Cmd).

        ``mounts``: host folders shared on purpose, ``Mount(host, path, read_only=True)``
        or ``"HOST:PATH[:ro|rw]"``; its clones share them too (see ``Mount``).

        ``desktop``: start a desktop inside (``True``, ``"1280x800x24"`` or a ``DesktopSpec``;
        see :mod:`bunshin.workspace.desktop`); the workspace is removed if it fails to start.

        ``network``: ``"none"`` (loopback only, the default) or ``"egress"``: an address, a
        default route and NAT out, under the policy of ``allow`` and ``deny`` (CIDRs,
        addresses, domain names, ``*.domain``) and ``limits`` (connections, bytes/s); see
        docs/guides/network.md."""
        cfg = config or Config.from_env()
        spec = DesktopSpec.parse(desktop)
        policy = Policy.of(allow, deny, limits) if (allow or deny or limits) else None
        with Store.open(cfg.db_path) as store:
            rec = container.create(cfg, store, image=image, name=name, memory=memory, pids=pids,
                                   command=list(command) if command else None, mounts=mounts,
                                   network=network, policy=policy)
        ws = cls(cfg, rec)
        if spec is not None:
            try:
                Desktop.start(ws, spec)
            except BaseException:
                ws.remove()
                raise
        return ws

    @classmethod
    def get(cls, ref: str, *, config: Config | None = None) -> Workspace:
        """An existing workspace by id, id prefix or name."""
        cfg = config or Config.from_env()
        with Store.open(cfg.db_path) as store:
            return cls(cfg, store.get_workspace(ref))

    @classmethod
    def list(cls, *, config: Config | None = None) -> builtins.list[WorkspaceInfo]:
        """Every workspace of this home (``config``: the environment's), as :class:`WorkspaceInfo`;
        not the clones made ahead of their restore (``Snapshot.restore(ahead=True)``)."""
        cfg = config or Config.from_env()
        with Store.open(cfg.db_path) as store:
            return [WorkspaceInfo.of(r) for r in store.list_workspaces() if not r.extra.get(rsnap.MADE_AHEAD)]

    def remove(self) -> None:
        """Kill every process, free every mount, cgroup and file of this workspace."""
        with Store.open(self._config.db_path) as store:
            container.destroy(self._config, store, self._record)
            rsnap.sweep(self._config, store)

    # network ---------------------------------------------------------------------

    def set_network_policy(self, allow: Sequence[str] = (), deny: Sequence[str] = (),
                           limits: Limits | None = None) -> None:
        """Replace this running workspace's egress policy (its clones keep theirs); open
        connections stay. StateConflict if it was created without ``network="egress"``."""
        policy = Policy.of(allow, deny, limits)
        with Store.open(self._config.db_path) as store:
            if rnet.set_policy(self._config, store, self.id, policy) is None:
                raise StateConflict(f"workspace {self.id} has no network to set a policy on",
                                    hint="create it with network='egress' (--network egress)")

    def network_policy(self) -> Policy | None:
        """This workspace's egress policy; None without egress."""
        with Store.open(self._config.db_path) as store:
            return rnet.policy_of(self._config, store, self.id)

    def network_address(self) -> str | None:
        """This workspace's IPv4 address on its link out; None without egress."""
        with Store.open(self._config.db_path) as store:
            slot = rnet.slot_of(self._config, store, self.id)
        return None if slot is None else str(slot.address.ip)

    # fork ------------------------------------------------------------------------

    def snapshot(self, *, mode: SnapshotMode | str = SnapshotMode.COW) -> Snapshot:
        """Capture this running workspace (it keeps running); kept until ``remove()``d."""
        with Store.open(self._config.db_path) as store:
            return Snapshot(self._config, rsnap.take(self._config, store, self._record, keep=True, mode=mode))

    def fork(self, n: int = 1, *, mode: SnapshotMode | str = SnapshotMode.COW) -> ForkResult[Workspace]:
        """``n`` live clones that continue from this instant; all of them or none.

        ``mode="cow"`` shares memory and files copy-on-write; ``"copy"`` is a plain
        CRIU restore with private pages (for comparison). Returns a list of the clones
        whose ``timings`` (:class:`~bunshin.workspace.forks.ForkTimings`) hold the
        parent's pause, the dump and each clone's restore (also kept as ``last_fork``,
        the fork's snapshot record, freed with the last clone).
        """
        with Store.open(self._config.db_path) as store:
            snap, recs = rsnap.fork(self._config, store, self._record, n, mode=mode)
        self.last_fork = snap
        timings = ForkTimings.of(snap, (r.extra.get("restore_ms") for r in recs))
        return ForkResult((Workspace(self._config, r) for r in recs), timings)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Workspace(id={self.id!r}, image={self._record.image!r})"

    # identity --------------------------------------------------------------------

    @property
    def id(self) -> str:
        """The workspace's id (``ws-`` and 12 hex digits)."""
        return self._record.id

    @property
    def name(self) -> str | None:
        """The name given at create, if any."""
        return self._record.name

    @property
    def record(self) -> WorkspaceRecord:
        """The stored record: mounts, cgroups, pids, parent, limits."""
        return self._record

    @property
    def config(self) -> Config:
        """The home and settings this workspace lives under."""
        return self._config

    def info(self) -> WorkspaceInfo:
        """What ``bunshin ls`` shows of it."""
        return WorkspaceInfo.of(self._record)

    def is_alive(self) -> bool:
        """Whether its init process still runs (the same process, not a reused pid)."""
        return container.is_alive(self._record)

    # using it --------------------------------------------------------------------

    def agent(self) -> AgentClient:
        """The client of the in-workspace agent (the runtime's; layers above use the
        protocol's sub-objects instead); raises if the workspace is gone."""
        if not container.is_alive(self._record):
            raise StateConflict(
                f"workspace {self.id} is not running",
                hint="it was removed or its processes died; `bunshin rm` it and create a new one",
            )
        return container.agent(self._record)

    @overload
    def exec(
        self,
        command: str | Sequence[str],
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
        command: str | Sequence[str],
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
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]: ...

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]:
        """Run one command (a shell string or an argv list) and wait for it.

        ``timeout``: seconds, finite and at most ``limits.MAX_TIMEOUT_S`` (7 days); none given,
        ``limits.DEFAULT_EXEC_TIMEOUT_S`` (600 s). Past it the command's whole process group is
        killed and the result says ``timed_out`` (``exit_code`` -9). ``text=False``
        returns ``stdout``/``stderr`` as the exact bytes the command wrote (no
        decoding, no truncation note; see ``*_truncated``).
        """
        return self.commands.run(command, timeout=timeout, cwd=cwd, env=env, stdin=stdin, text=text)

    def shell(self, *, cwd: str | None = None, env: dict[str, str] | None = None) -> Session:
        """A new persistent bash session (on a pty) inside the workspace."""
        return Session(self, self.sessions.open("bash", cwd=cwd, env=env))

    def processes(self) -> builtins.list[ProcessInfo]:
        """The processes inside, as the workspace's own pid namespace numbers them."""
        return self.agent().processes()

    def connect_port(self, port: int, *, timeout: float = 5.0) -> socket.socket:
        """A TCP connection to ``127.0.0.1:port`` inside the workspace's network, made from
        the host (the caller closes it); ``Unreachable`` when nothing listens there."""
        pid = self._record.pid
        if pid is None or not container.is_alive(self._record):
            raise StateConflict(f"workspace {self.id} has no process to reach its network through",
                                hint="it is not running; create a new one")
        return port_socket.connect_port(pid, port, timeout=timeout,
                                        still_ours=lambda: container.is_alive(self._record))

    def stats(self) -> WorkspaceStats:
        """Memory (cgroup, PSS, USS, anonymous) and processes, read on the host."""
        return rstats.collect(self._record)

    # ports in --------------------------------------------------------------------

    def publish(self, port: int, host_port: int | None = None, host: str = "127.0.0.1") -> Published:
        """Forward ``host:host_port`` on the host (loopback by default; ``host_port`` None:
        a free port) to ``port`` inside, until ``unpublish`` or the workspace ends. Clones
        do not inherit it; publish on a clone for its own."""
        return rpublish.publish(self._config, self._record, port, host_port=host_port, host=host)

    def published(self) -> builtins.list[Published]:
        """This workspace's published ports."""
        return rpublish.published(self._config, self.id)

    def unpublish(self, host_port: int) -> None:
        """Stop forwarding ``host_port``."""
        rpublish.unpublish(self._config, self.id, host_port)

    def set_cpu_priority(self, nice: int) -> None:
        """The CPU priority of the whole workspace, as a nice value 0..19 (its cgroup's
        CPU weight): speculative forks run at 19 and go back to 0 when adopted."""
        rec = self._record
        WorkspaceCgroup.of_record(rec).set_cpu_nice(nice)


class Snapshot:
    """A captured workspace state; restore it any number of times.

    Get one with ``Workspace.snapshot()``, :meth:`get` or :meth:`load`.
    """

    def __init__(self, config: Config, record: rsnap.SnapshotRecord) -> None:
        self._config = config
        self._record = record

    @property
    def id(self) -> str:
        """The snapshot's id (``snap-`` and hex digits)."""
        return self._record.id

    @property
    def record(self) -> rsnap.SnapshotRecord:
        """The stored record: source, mode, pause and dump times, sizes."""
        return self._record

    @property
    def size_bytes(self) -> int:
        """What it holds: memory files, images and its file layer."""
        rec = self._record
        return rec.memfile_bytes + rec.image_bytes + rec.layer_bytes

    @classmethod
    def get(cls, ref: str, *, config: Config | None = None) -> Snapshot:
        """A snapshot by id or unique id prefix."""
        cfg = config or Config.from_env()
        with Store.open(cfg.db_path) as store:
            return cls(cfg, rsnap.get(store, ref))

    @classmethod
    def list(cls, *, config: Config | None = None) -> builtins.list[Snapshot]:
        """Every snapshot of this home (forks' and kept ones)."""
        cfg = config or Config.from_env()
        with Store.open(cfg.db_path) as store:
            return [cls(cfg, r) for r in rsnap.list_all(store)]

    @classmethod
    def load(cls, folder: str | Path, *, config: Config | None = None, trust: bool = False) -> Snapshot:
        """Bring back a snapshot written by :meth:`save` (kept until ``remove()``d).

        The folder is untrusted input: only one this home saved, unchanged, loads
        unless ``trust`` (then any folder does, still checked for what could harm the host).
        """
        cfg = config or Config.from_env()
        with Store.open(cfg.db_path) as store:
            return cls(cfg, folder_load.load(cfg, store, Path(folder), trust=trust))

    def save(self, folder: str | Path) -> Path:
        """Write images, memory files and layers into ``folder`` (new or empty)."""
        return folder_save.save(self._config, self._record, Path(folder))

    def restore(self, n: int = 1, *, ids: Sequence[str] | None = None, ahead: bool = False
                ) -> builtins.list[Workspace]:
        """``n`` new running workspaces in this state; all of them or none. ``ids``: the ids
        they take (free ones, e.g. of workspaces removed since); else new ones. ``ahead``
        (a restore of one, without ``ids``, of a snapshot without network): the next clone
        is made up to its criu run in the background, and this one is taken if it was
        (``runtime.snapshot.ahead``)."""
        ahead = ahead and n == 1 and ids is None and self._record.network == "none"
        ready = rsnap.ahead.take(self.id) if ahead else None
        with Store.open(self._config.db_path) as store:
            recs = rsnap.restore(self._config, store, self._record, n, ids=ids, ready=ready)
        if ahead:
            rsnap.ahead.want(self._config, self._record)
        return [Workspace(self._config, r) for r in recs]

    def remove(self) -> None:
        """Drop it; its files go once no restored workspace stacks on them (a clone made
        ahead is destroyed first)."""
        rsnap.ahead.release(self.id)
        with Store.open(self._config.db_path) as store:
            rsnap.remove(self._config, store, self._record)

    def __repr__(self) -> str:
        return f"Snapshot(id={self.id!r}, source={self._record.source!r})"


class Commands:
    """One-shot commands: ``ws.commands.run("make test", timeout=60)``."""

    def __init__(self, ws: Workspace) -> None:
        self._ws = ws

    @overload
    def run(
        self,
        command: str | Sequence[str],
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
        command: str | Sequence[str],
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
        command: str | Sequence[str],
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
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        max_output: int | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]:
        """Run and wait (``timeout``: default 600 s); ``text=False``: output as exact bytes
        (see :meth:`Workspace.exec`)."""
        timeout = exec_timeout(timeout)
        argv, cmd = (None, command) if isinstance(command, str) else (list(command), None)
        return self._ws.agent().exec(argv=argv, cmd=cmd, cwd=cwd, env=env, timeout=timeout,
                                     stdin=stdin, max_output=max_output, text=text)

    def spawn(self, command: str | Sequence[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None) -> int:
        """Start a long-lived background process; returns its pid inside the workspace."""
        argv, cmd = (None, command) if isinstance(command, str) else (list(command), None)
        return self._ws.agent().spawn(argv=argv, cmd=cmd, cwd=cwd, env=env)

    def kill(self, pid: int, signal: int = 15, *, group: bool = False) -> None:
        """Send ``signal`` to a process inside (``group``: to its process group; a spawned
        process leads its own)."""
        self._ws.agent().kill(pid, signal, group=group)


class Files:
    """Files inside the workspace: ``ws.files.write("/x", b"...")``."""

    def __init__(self, ws: Workspace) -> None:
        self._ws = ws

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """The file's bytes from ``offset``: at most ``length``, else up to its end (refused,
        ``PayloadTooLarge``, past ``MAX_FILE_BYTES``: read such a file in parts)."""
        return self._ws.agent().read_file(path, offset=offset, length=length)

    def stream(self, path: str, *, offset: int = 0, length: int | None = None,
               chunk: int = 1 << 20) -> Iterator[bytes]:
        """What :meth:`read` answers, in pieces of at most ``chunk`` bytes (one held at a time)."""
        return self._ws.agent().iter_file(path, offset=offset, length=length, chunk=chunk)

    def read_text(self, path: str) -> str:
        """The whole file at ``path`` as UTF-8 text."""
        return self.read(path).decode()

    def write(self, path: str, data: bytes | str, *, mode: int | None = None) -> int:
        """Write ``data`` to ``path`` (parent folders made; ``mode``: its permission bits); the bytes written."""
        raw = data.encode() if isinstance(data, str) else data
        return self._ws.agent().write_file(path, raw, mode=mode, mkdirs=True)

    def write_stream(self, path: str, pieces: Iterable[bytes], *, mode: int | None = None) -> int:
        """Write the bytes of ``pieces`` as they come (one held at a time; parent folders
        made); the file's size. A source that fails midway leaves what came before it."""
        return self._ws.agent().write_stream(path, pieces, mode=mode, mkdirs=True)

    def list(self, path: str = "/") -> builtins.list[FileEntry]:
        """The entries of the folder ``path``."""
        return self._ws.agent().list_dir(path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file (or, ``recursive``, the folder) at ``path``."""
        self._ws.agent().remove(path, recursive=recursive)


class Sessions:
    """Persistent shells on a pty: ``sid = ws.sessions.open(); ws.sessions.run(sid, "cd /w")``.

    Sessions are workspace state: a fork's clones have them, as they were at the fork.
    """

    def __init__(self, ws: Workspace) -> None:
        self._ws = ws

    def list(self) -> builtins.list[SessionInfo]:
        """The open sessions (shells and interpreters) of the workspace."""
        return self._ws.agent().session_list()

    def open(self, kind: str = "bash", *, cwd: str | None = None,
             env: dict[str, str] | None = None) -> str:
        """Open a persistent shell session (``bash`` or ``sh``) and return its id."""
        return self._ws.agent().session_open(kind=kind, cwd=cwd, env=env)

    def run(self, session_id: str, command: str, *, timeout: float | None = None,
            max_output: int | None = None) -> SessionResult:
        """Run ``command`` in the session; a timeout interrupts the command, not the session."""
        return self._ws.agent().session_run(session_id, command, timeout=check_timeout(timeout),
                                            max_output=max_output)

    def close(self, session_id: str) -> None:
        """End the session ``session_id`` (its processes are killed)."""
        self._ws.agent().session_close(session_id)

    def attach(self, kind: str = "bash", *, rows: int | None = None, cols: int | None = None,
               cwd: str | None = None, env: dict[str, str] | None = None) -> socket.socket:
        """An interactive shell on a new pty, as a connected socket: after the agent's
        answer a raw byte pipe to the pty both ways (``bunshin sh``). The caller closes it.
        Local workspaces only: the socket is the agent's."""
        return self._ws.agent().attach(kind, rows=rows, cols=cols, cwd=cwd, env=env)


class Session:
    """One persistent shell as an object: state (cwd, variables, functions, history)
    carries across runs."""

    def __init__(self, ws: Workspace, session_id: str) -> None:
        self._ws = ws
        self.id = session_id

    def run(self, command: str, *, timeout: float | None = None) -> SessionResult:
        """Run ``command`` in the session; a timeout interrupts the command, not the session."""
        return self._ws.sessions.run(self.id, command, timeout=timeout)

    def close(self) -> None:
        """End this session."""
        self._ws.sessions.close(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _conforms(ws: Workspace, snap: Snapshot) -> tuple[WorkspaceAPI, SnapshotAPI]:
    """Never called: mypy checks here that the local classes satisfy the protocols."""
    return ws, snap
