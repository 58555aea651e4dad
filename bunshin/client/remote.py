"""Workspaces and snapshots on a served host: the third implementation of the protocols.

Every call is one HTTP request; the records that come back are the same types a local
workspace returns (``ExecResult``, ``SessionResult``, ``FileEntry``...), and errors are
the same classes. Constructing these objects does no I/O.
"""

from __future__ import annotations

import builtins
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, overload

import httpx

from ..api import models as m
from ..api.archive import untar
from ..errors import InvalidArgument
from ..runtime.agent_host.types import (
    ExecResult,
    FileEntry,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)
from ..runtime.container.stats import WorkspaceStats
from ..runtime.kernel.limits import check_timeout, exec_timeout
from ..runtime.state.records import SnapshotMode
from ..tools.spec import Observation
from ..workspace.forks import ForkResult
from ..workspace.protocol import SnapshotAPI, WorkspaceAPI


class Client(Protocol):
    """What remote objects need of :class:`bunshin.client.Client`: its URL and its calls."""

    @property
    def url(self) -> str: ...

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: dict[str, Any] | None = None, wait_s: float | None = None,
                default_wait: bool = True, idempotent: bool = False) -> httpx.Response: ...

    def stream_bytes(self, method: str, path: str, *, wait_s: float | None = None) -> Iterator[bytes]: ...

    def stream_lines(self, method: str, path: str, *, json: Any = None,
                     wait_s: float | None = None) -> Iterator[dict[str, Any]]: ...


GRACE_S = 30.0  # past a command's own timeout, the client stops waiting for the server


def _wait(timeout: float | None) -> float | None:
    return None if timeout is None else timeout + GRACE_S


class RemoteWorkspace:
    """A workspace on a ``bunshin serve`` host (get one from :class:`~bunshin.client.Client`)."""

    def __init__(self, client: Client, out: m.WorkspaceOut) -> None:
        self._client = client
        self._out = out
        self._path = f"/v1/workspaces/{out.id}"
        self.commands = RemoteCommands(self)
        self.files = RemoteFiles(self)
        self.sessions = RemoteSessions(self)

    @property
    def id(self) -> str:
        """The workspace's id."""
        return self._out.id

    @property
    def info(self) -> m.WorkspaceOut:
        """What the server said of it when this object was made."""
        return self._out

    @property
    def client(self) -> Client:
        """The client it was made through."""
        return self._client

    @property
    def path(self) -> str:
        """Its URL path on the server (``/v1/workspaces/ID``)."""
        return self._path

    def __repr__(self) -> str:
        return f"RemoteWorkspace({self.id!r} on {self._client.url})"

    def __enter__(self) -> RemoteWorkspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None,
             text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None,
             text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None,
             text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    def exec(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
             env: dict[str, str] | None = None, stdin: str | None = None,
             text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        """Run one command and wait (:meth:`bunshin.Workspace.exec`; ``timeout`` default 600 s)."""
        return self.commands.run(command, timeout=timeout, cwd=cwd, env=env, stdin=stdin, text=text)

    def processes(self) -> builtins.list[ProcessInfo]:
        """The processes inside."""
        r = self._client.request("GET", f"{self._path}/processes")
        return [m.ProcessOut.model_validate(p).record() for p in r.json()]

    def stats(self) -> WorkspaceStats:
        """Memory and processes, as the server reads them."""
        return m.StatsOut.model_validate(self._client.request("GET", f"{self._path}/stats").json()).record()

    def network(self) -> m.NetworkOut:
        """Its network: mode (``none``/``egress``), address, allow and deny rules."""
        return m.NetworkOut.model_validate(self._client.request("GET", f"{self._path}/network").json())

    def set_network_policy(self, allow: Sequence[str] = (), deny: Sequence[str] = ()) -> m.NetworkOut:
        """Replace its egress policy (its clones keep theirs)."""
        body = m.build(m.NetworkPolicyIn, allow=list(allow), deny=list(deny)).model_dump()
        return m.NetworkOut.model_validate(self._client.request("PUT", f"{self._path}/network", json=body).json())

    def publish(self, port: int, host_port: int | None = None) -> m.PortOut:
        """Publish ``port`` on the server host's loopback (``host_port`` None: a free one)."""
        body = m.build(m.PublishPort, port=port, host_port=host_port).model_dump()
        return m.PortOut.model_validate(self._client.request("POST", f"{self._path}/ports", json=body).json())

    def published(self) -> builtins.list[m.PortOut]:
        """Its published ports."""
        return [m.PortOut.model_validate(p) for p in self._client.request("GET", f"{self._path}/ports").json()]

    def unpublish(self, host_port: int) -> None:
        """Stop publishing ``host_port``."""
        self._client.request("DELETE", f"{self._path}/ports/{host_port}")

    def set_cpu_priority(self, nice: int) -> None:
        """The whole workspace's CPU priority as a nice value 0..19."""
        self._client.request("PUT", f"{self._path}/cpu-priority", json=m.build(m.Priority, nice=nice).model_dump())

    def is_alive(self) -> bool:
        """Whether the server reports it running."""
        out = m.WorkspaceOut.model_validate(self._client.request("GET", self._path).json())
        return out.state == "running"

    def snapshot(self, *, mode: SnapshotMode | str = SnapshotMode.COW) -> RemoteSnapshot:
        """Capture it while it keeps running; kept until removed."""
        r = self._client.request("POST", f"{self._path}/snapshots", default_wait=False, idempotent=True,
                                 json=m.build(m.TakeSnapshot, mode=mode).model_dump(mode="json"))
        return RemoteSnapshot(self._client, m.SnapshotOut.model_validate(r.json()))

    def fork(self, n: int = 1, *, mode: SnapshotMode | str = SnapshotMode.COW,
             ttl: float | None = None) -> builtins.list[RemoteWorkspace]:
        """``n`` clones; ``ttl``: their lease (default their parent's, if it has one). The list has
        the fork's ``timings`` (:class:`~bunshin.workspace.forks.ForkTimings`), as a local fork's."""
        r = self._client.request("POST", f"{self._path}/fork", default_wait=False, idempotent=True,
                                 json=m.build(m.ForkRequest, count=n, mode=mode, ttl=ttl).model_dump(mode="json"))
        out = m.ForkOut.model_validate(r.json())
        forks = [RemoteWorkspace(self._client, w) for w in out.forks]
        timings = out.timings()
        return forks if timings is None else ForkResult(forks, timings)

    def remove(self) -> None:
        """Remove it on the server."""
        self._client.request("DELETE", self._path)

    def set_ttl(self, ttl: float | None) -> float | None:
        """Lease it for ``ttl`` more seconds from now (``None``: until removed); when it ends."""
        r = self._client.request("PUT", f"{self._path}/ttl", json=m.build(m.SetTTL, ttl=ttl).model_dump())
        self._out = m.WorkspaceOut.model_validate(r.json())
        return self._out.expires_at

    def run_tool(self, name: str, arguments: dict[str, Any] | str | None = None, *,
                 workdir: str = "/") -> Observation:
        """One call of the server's built-in tool set (desktop tools included) in this workspace
        (no cache)."""
        r = self._client.request("POST", f"{self._path}/tools/{name}", default_wait=False,
                                 json={"arguments": arguments or {}, "workdir": workdir})
        return Observation(**r.json())


class RemoteSnapshot:
    """A snapshot on a ``bunshin serve`` host."""

    def __init__(self, client: Client, out: m.SnapshotOut) -> None:
        self._client = client
        self._out = out

    @property
    def id(self) -> str:
        """The snapshot's id."""
        return self._out.id

    @property
    def size_bytes(self) -> int:
        """What it holds: memory files, images and its file layer."""
        return self._out.size_bytes

    @property
    def info(self) -> m.SnapshotOut:
        """The server's description of it."""
        return self._out

    def __repr__(self) -> str:
        return f"RemoteSnapshot({self.id!r} on {self._client.url})"

    def restore(self, n: int = 1, *, ttl: float | None = None) -> builtins.list[RemoteWorkspace]:
        """``n`` new workspaces; ``ttl``: their lease (seconds; the server removes them then)."""
        r = self._client.request("POST", f"/v1/snapshots/{self.id}/restore", default_wait=False, idempotent=True,
                                 json=m.build(m.RestoreRequest, count=n, ttl=ttl).model_dump())
        return [RemoteWorkspace(self._client, m.WorkspaceOut.model_validate(w)) for w in r.json()]

    def remove(self) -> None:
        """Remove it on the server."""
        self._client.request("DELETE", f"/v1/snapshots/{self.id}")

    def set_ttl(self, ttl: float | None) -> None:
        """Lease it for ``ttl`` more seconds from now (``None``: until removed)."""
        self._client.request("PUT", f"/v1/snapshots/{self.id}/ttl", json=m.build(m.SetTTL, ttl=ttl).model_dump())

    def save(self, folder: str | Path) -> Path:
        """Download it into the local folder ``folder`` (new or empty), as
        :meth:`bunshin.Snapshot.save` writes it: :meth:`Client.load_snapshot` (or
        ``Snapshot.load``, on a home sharing the server's ``snapshot.key``) takes it back."""
        dest = Path(folder).absolute()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidArgument(f"{dest} exists and is not an empty folder", hint="save into a new folder")
        dest.parent.mkdir(parents=True, exist_ok=True)
        spool = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tar")
        try:
            with open(spool, "xb") as f:
                for chunk in self._client.stream_bytes("GET", f"/v1/snapshots/{self.id}/archive"):
                    f.write(chunk)
            if dest.exists():
                dest.rmdir()
            untar(spool, dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        finally:
            spool.unlink(missing_ok=True)
        return dest


class RemoteCommands:
    def __init__(self, ws: RemoteWorkspace) -> None:
        self._ws = ws

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: Literal[True] = True) -> ExecResult[str]: ...

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: Literal[False]) -> ExecResult[bytes]: ...

    @overload
    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: bool = True) -> ExecResult[str] | ExecResult[bytes]: ...

    def run(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: str | None = None, max_output: int | None = None,
            text: bool = True) -> ExecResult[str] | ExecResult[bytes]:
        """Run and wait, as :meth:`bunshin.Workspace.exec` (``timeout``: default 600 s)."""
        timeout = exec_timeout(timeout)
        req = m.build(m.ExecRequest, command=command if isinstance(command, str) else list(command),
                      timeout=timeout, cwd=cwd, env=env, stdin=stdin, max_output=max_output, text=text)
        r = self._ws.client.request("POST", f"{self._ws.path}/exec", json=req.model_dump(),
                                    wait_s=_wait(timeout), default_wait=False)
        out = m.ExecOut.model_validate(r.json())
        return out.text_result() if text else out.bytes_result()

    def stream(self, command: str | Sequence[str], *, timeout: float | None = None, cwd: str | None = None,
               env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
        """Run and follow: ``{"stream": "stdout"|"stderr", "data": str}`` as output comes, then
        one ``{"exit_code", "timed_out", "duration_s"}``. Leaving the loop early kills the command."""
        timeout = check_timeout(timeout)
        req = m.build(m.ExecRequest, command=command if isinstance(command, str) else list(command),
                      timeout=timeout, cwd=cwd, env=env)
        yield from self._ws.client.stream_lines("POST", f"{self._ws.path}/exec/stream", json=req.model_dump(),
                                                wait_s=_wait(timeout))

    def spawn(self, command: str | Sequence[str], *, cwd: str | None = None,
              env: dict[str, str] | None = None) -> int:
        """Start a command in the background; its pid inside."""
        req = m.build(m.SpawnRequest, command=command if isinstance(command, str) else list(command),
                      cwd=cwd, env=env)
        r = self._ws.client.request("POST", f"{self._ws.path}/spawn", json=req.model_dump())
        return m.SpawnOut.model_validate(r.json()).pid


class RemoteFiles:
    def __init__(self, ws: RemoteWorkspace) -> None:
        self._ws = ws

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of the file at ``path`` (from ``offset``, ``length`` of them or to the end)."""
        params: dict[str, str | int] = {"path": path, "offset": offset}
        if length is not None:
            params["length"] = length
        return self._ws.client.request("GET", f"{self._ws.path}/files/content", params=params).content

    def read_text(self, path: str) -> str:
        """The whole file at ``path`` as UTF-8 text."""
        return self.read(path).decode()

    def write(self, path: str, data: bytes | str, *, mode: int | None = None) -> int:
        """Write ``data`` to ``path`` (parent folders made); the bytes written."""
        raw = data.encode() if isinstance(data, str) else data
        r = self._ws.client.request("PUT", f"{self._ws.path}/files/content", content=raw,
                                    params={"path": path, "mode": mode})
        return m.Written.model_validate(r.json()).bytes

    def list(self, path: str = "/") -> builtins.list[FileEntry]:
        """The entries of the folder ``path``."""
        r = self._ws.client.request("GET", f"{self._ws.path}/files", params={"path": path})
        return [m.FileOut.model_validate(e).record() for e in r.json()]

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove the file (or, ``recursive``, the folder) at ``path``."""
        self._ws.client.request("DELETE", f"{self._ws.path}/files",
                                params={"path": path, "recursive": str(recursive).lower()})


class RemoteSessions:
    def __init__(self, ws: RemoteWorkspace) -> None:
        self._ws = ws

    def list(self) -> builtins.list[SessionInfo]:
        """The open sessions."""
        r = self._ws.client.request("GET", f"{self._ws.path}/sessions")
        return [m.SessionOut.model_validate(s).record() for s in r.json()]

    def open(self, kind: str = "bash", *, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
        """Open a persistent shell session (``bash`` or ``sh``); its id."""
        r = self._ws.client.request("POST", f"{self._ws.path}/sessions",
                                    json=m.build(m.OpenSession, kind=kind, cwd=cwd, env=env).model_dump())
        return m.OpenedSession.model_validate(r.json()).session_id

    def run(self, session_id: str, command: str, *, timeout: float | None = None,
            max_output: int | None = None) -> SessionResult:
        """Run ``command`` in the session; a timeout interrupts the command, not the session."""
        timeout = check_timeout(timeout)
        req = m.build(m.RunInSession, command=command, timeout=timeout, max_output=max_output)
        r = self._ws.client.request("POST", f"{self._ws.path}/sessions/{session_id}/run", json=req.model_dump(),
                                    wait_s=_wait(timeout), default_wait=False)
        return m.SessionRunOut.model_validate(r.json()).record()

    def close(self, session_id: str) -> None:
        """End the session ``session_id``."""
        self._ws.client.request("DELETE", f"{self._ws.path}/sessions/{session_id}")


def _conforms(ws: RemoteWorkspace, snap: RemoteSnapshot) -> tuple[WorkspaceAPI, SnapshotAPI]:
    """Never called: mypy checks here that the remote classes satisfy the protocols."""
    return ws, snap
