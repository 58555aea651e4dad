"""The HTTP client of ``bunshin serve``: one connection pool, errors rebuilt as bunshin's own."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from ..api import models as m
from ..errors import BunshinError, InvalidArgument, Unreachable
from .groups import RemoteGroup, TaskLike, join
from .remote import RemoteSnapshot, RemoteWorkspace

DEFAULT_URL = "http://127.0.0.1:8770"
#: Seconds added to a command's own timeout before the client stops waiting for the answer.
ANSWER_GRACE_S = 30.0


class Client:
    """A ``bunshin serve`` host. ``token`` (or ``token_file``, or ``BUNSHIN_TOKEN``) is required.

    ``timeout``: seconds for calls without a timeout of their own (forks, restores,
    file transfers); ``None`` waits as long as the server works.
    """

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None,
                 token_file: str | Path | None = None, timeout: float | None = 300.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        if token is None and token_file is not None:
            token = Path(token_file).read_text().strip()
        token = token or os.environ.get("BUNSHIN_TOKEN")
        if not token:
            raise InvalidArgument("no API token", hint="pass token= or token_file=, or set BUNSHIN_TOKEN "
                                                       "(the server's BUNSHIN_HOME/server.token)")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout, transport=transport)

    @classmethod
    def from_env(cls) -> Client:
        """``BUNSHIN_URL`` (default the loopback port) and ``BUNSHIN_TOKEN``."""
        return cls(os.environ.get("BUNSHIN_URL", DEFAULT_URL))

    # --- the wire ---------------------------------------------------------------------

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: dict[str, Any] | None = None, wait_s: float | None = None,
                default_wait: bool = True) -> httpx.Response:
        """One call; a bunshin error answered by the server is raised as its own class.

        ``wait_s``: how long the server may take (a command's timeout plus a grace);
        with ``default_wait`` off and no ``wait_s``, no limit."""
        timeout: float | None = self.timeout if default_wait and wait_s is None else wait_s
        try:
            r = self._http.request(method, path, json=json, content=content,
                                   params={k: v for k, v in (params or {}).items() if v is not None},
                                   timeout=httpx.Timeout(timeout, connect=10.0))
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{method} {self.url}{path}: no answer within {timeout} s ({exc})",
                              hint="the call may still be running on the server") from None
        except httpx.TransportError as exc:
            raise Unreachable(f"{method} {self.url}{path}: {exc}",
                              hint="is `bunshin serve` running there? (GET /v1/health needs no token)") from None
        if r.status_code >= 400:
            raise _error_of(r)
        return r

    def health(self) -> m.Health:
        return m.Health.model_validate(self.request("GET", "/v1/health").json())

    # --- workspaces and snapshots ---------------------------------------------------------

    def create(self, image: str = "host", *, name: str | None = None, memory: str | int | None = "2G",
               pids: int | None = 512) -> RemoteWorkspace:
        """A new workspace on the host (``image``: ``host``)."""
        (ws,) = self.create_many(1, image=image, name=name, memory=memory, pids=pids)
        return ws

    def create_many(self, count: int, *, image: str = "host", name: str | None = None,
                    memory: str | int | None = "2G", pids: int | None = 512) -> builtins.list[RemoteWorkspace]:
        """``count`` new workspaces: all of them or none."""
        req = m.build(m.CreateWorkspace, image=image, name=name, memory=memory, pids=pids, count=count)
        r = self.request("POST", "/v1/workspaces", json=req.model_dump(mode="json"), default_wait=False)
        return [RemoteWorkspace(self, m.WorkspaceOut.model_validate(w)) for w in r.json()]

    def get(self, ref: str) -> RemoteWorkspace:
        return RemoteWorkspace(self, m.WorkspaceOut.model_validate(self.request("GET", f"/v1/workspaces/{ref}").json()))

    def list(self) -> list[m.WorkspaceOut]:
        return [m.WorkspaceOut.model_validate(w) for w in self.request("GET", "/v1/workspaces").json()]

    def snapshot(self, ref: str) -> RemoteSnapshot:
        out = m.SnapshotOut.model_validate(self.request("GET", f"/v1/snapshots/{ref}").json())
        return RemoteSnapshot(self, out)

    def snapshots(self) -> builtins.list[RemoteSnapshot]:
        return [RemoteSnapshot(self, m.SnapshotOut.model_validate(s))
                for s in self.request("GET", "/v1/snapshots").json()]

    def group(self, *, key: str, n: int = 1, image: str | None = None, snapshot: str | None = None,
              task: TaskLike | None = None, tools: builtins.list[str] | None = None,
              speculation: bool = True) -> RemoteGroup:
        """``n`` new trajectories of the group ``key``, on the host's shared prefix cache; the
        first caller of the key (from any process) builds its root from exactly one of
        ``image``, ``snapshot`` or ``task`` (see :mod:`bunshin.client.groups`)."""
        return join(self, key=key, n=n, image=image, snapshot=snapshot, task=task, tools=tools,
                    speculation=speculation)

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"


def _error_of(r: httpx.Response) -> BunshinError:
    try:
        body = m.ErrorOut.model_validate(r.json())
    except ValueError:
        return BunshinError(f"HTTP {r.status_code} from {r.request.method} {r.request.url}: {r.text[:500]}",
                            hint="not a bunshin server answer: check the URL")
    return BunshinError.from_dict(body.model_dump())
