"""The HTTP client of ``bunshin serve``: one connection pool, errors rebuilt as bunshin's own,
calls refused by admission control resent after Retry-After, mutations idempotent."""

from __future__ import annotations

import builtins
import functools
import json as _json
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from ..api import models as m
from ..api import rollouts as r
from ..api.archive import CHUNK, MEDIA_TYPE, tar_chunks
from ..errors import BunshinError, InvalidArgument, RateLimited, RequestInProgress, Unreachable
from ..runtime.snapshot.folder import MANIFEST
from ..workspace.protocol import HostAPI
from .groups import RemoteGroup, TaskLike, join
from .images import RemoteImages
from .remote import RemoteSnapshot, RemoteWorkspace

DEFAULT_URL = "http://127.0.0.1:8770"
#: Seconds added to a command's own timeout before the client stops waiting for the answer.
ANSWER_GRACE_S = 30.0


@dataclass(frozen=True)
class Retry:
    """How long a call is sent again: at most ``attempts`` sends within ``total_s``
    seconds, each wait the server's Retry-After (capped at ``max_wait_s``), or for an
    idempotent call that could not connect ``backoff_s`` doubled each time.
    ``Retry(attempts=1)`` sends every call once."""

    attempts: int = 10
    total_s: float = 120.0
    max_wait_s: float = 30.0
    backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.total_s < 0 or self.max_wait_s < 0 or self.backoff_s < 0:
            raise InvalidArgument(f"bad {self!r}", hint="attempts >= 1 and times >= 0")


class Client:
    """A ``bunshin serve`` host. ``token`` (or ``token_file``, or ``BUNSHIN_TOKEN``) is required.

    ``timeout``: seconds for calls without a timeout of their own (forks, restores,
    file transfers); ``None`` waits as long as the server works. ``retry``: how calls
    refused with 429 (and idempotent mutations that failed to connect) are resent.
    Creates, forks, snapshots and restores carry an ``Idempotency-Key``, one per call.
    """

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None,
                 token_file: str | Path | None = None, timeout: float | None = 300.0,
                 retry: Retry | None = None, transport: httpx.BaseTransport | None = None) -> None:
        if token is None and token_file is not None:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise InvalidArgument(f"cannot read the API token file {token_file}: {e.strerror}",
                                      hint="give the server's token file (BUNSHIN_HOME/server.token on its "
                                           "host), or set BUNSHIN_TOKEN") from None
        token = token or os.environ.get("BUNSHIN_TOKEN")
        if not token:
            raise InvalidArgument("no API token", hint="pass token= or token_file=, or set BUNSHIN_TOKEN "
                                                       "(the server's BUNSHIN_HOME/server.token)")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.retry = retry or Retry()
        self._http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"},
                                  timeout=timeout, transport=transport)

    @classmethod
    def from_env(cls) -> Client:
        """``BUNSHIN_URL`` (default the loopback port) and ``BUNSHIN_TOKEN``."""
        return cls(os.environ.get("BUNSHIN_URL", DEFAULT_URL))

    # --- the wire ---------------------------------------------------------------------

    def request(self, method: str, path: str, *, json: Any = None, content: bytes | None = None,
                params: dict[str, Any] | None = None, wait_s: float | None = None,
                default_wait: bool = True, idempotent: bool = False) -> httpx.Response:
        """One logical call; a bunshin error answered by the server is raised as its own class.

        ``wait_s``: how long the server may take (a command's timeout plus a grace);
        with ``default_wait`` off and no ``wait_s``, no limit. Refused by admission
        control (429), the call is sent again after the answer's Retry-After, within
        ``self.retry``. ``idempotent``: a mutation made safe to resend: one
        ``Idempotency-Key`` for all its attempts, and resent also when it could not
        connect or the first attempt with the key still runs (409 ``request_in_progress``).
        A connection lost mid-call is never resent (the server may have died in it)."""
        timeout: float | None = self.timeout if default_wait and wait_s is None else wait_s
        headers = {"Idempotency-Key": uuid.uuid4().hex} if idempotent else None
        send = functools.partial(self._http.request, method, path, json=json, content=content, headers=headers,
                                 params={k: v for k, v in (params or {}).items() if v is not None},
                                 timeout=httpx.Timeout(timeout, connect=10.0))
        deadline = time.monotonic() + self.retry.total_s
        for attempt in range(1, self.retry.attempts + 1):
            try:
                r = send()
            except httpx.TransportError as exc:
                err: BunshinError = _unreachable(method, f"{self.url}{path}", timeout, exc)
                # never sent (connect failed): safe to resend a keyed call. A connection lost
                # mid-call is not resent: the server may have died in it (``bunshin gc``)
                sent = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
                wait = None if sent or not idempotent else self.retry.backoff_s * 2 ** (attempt - 1)
            else:
                if r.status_code < 400:
                    return r
                err = _error_of(r)
                wait = _retry_after(r, err, idempotent)
            if wait is None or attempt == self.retry.attempts or time.monotonic() + wait > deadline:
                raise err
            time.sleep(min(wait, self.retry.max_wait_s))
        raise AssertionError("unreachable: the last attempt raises")

    def stream_bytes(self, method: str, path: str, *, wait_s: float | None = None) -> Iterator[bytes]:
        """A binary answer, a chunk at a time as the server sends it (not resent)."""
        try:
            with self._http.stream(method, path, timeout=httpx.Timeout(wait_s, connect=10.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_of(r)
                yield from r.iter_bytes(CHUNK)
        except httpx.TransportError as exc:
            raise _unreachable(method, f"{self.url}{path}", wait_s, exc) from None

    def upload(self, method: str, path: str, chunks: Iterable[bytes], *,
               headers: dict[str, str] | None = None) -> httpx.Response:
        """A call whose body is streamed from ``chunks`` (sent once: a body cannot be resent)."""
        try:
            r = self._http.request(method, path, content=chunks, headers=headers,
                                   timeout=httpx.Timeout(self.timeout, connect=10.0))
        except httpx.TransportError as exc:
            raise _unreachable(method, f"{self.url}{path}", self.timeout, exc) from None
        if r.status_code >= 400:
            raise _error_of(r)
        return r

    @property
    def images(self) -> RemoteImages:
        """The host's image store (``bunshin.client.images``)."""
        return RemoteImages(self)

    def stream_lines(self, method: str, path: str, *, json: Any = None,
                     wait_s: float | None = None) -> Iterator[dict[str, Any]]:
        """An NDJSON answer, one parsed line at a time as the server sends it (not resent)."""
        try:
            with self._http.stream(method, path, json=json, timeout=httpx.Timeout(wait_s, connect=10.0)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error_of(r)
                for line in r.iter_lines():
                    if line.strip():
                        yield _json.loads(line)
        except httpx.TransportError as exc:
            raise _unreachable(method, f"{self.url}{path}", wait_s, exc) from None

    def health(self) -> m.Health:
        """The server's health: version, workspaces, limits."""
        return m.Health.model_validate(self.request("GET", "/v1/health").json())

    # --- workspaces and snapshots ---------------------------------------------------------

    def create(self, image: str = "host", *, name: str | None = None, memory: str | int | None = "2G",
               pids: int | None = 512, ttl: float | None = None, network: str | None = None,
               allow: Sequence[str] = (), deny: Sequence[str] = ()) -> RemoteWorkspace:
        """A new workspace on the host (``image``: ``host``). ``ttl``: its lease in seconds:
        the server removes it then unless renewed (:meth:`RemoteWorkspace.set_ttl`).
        ``network``: ``none`` or ``egress`` (None: the server's default), under ``allow``
        and ``deny`` (CIDRs, addresses)."""
        (ws,) = self.create_many(1, image=image, name=name, memory=memory, pids=pids, ttl=ttl, network=network,
                                 allow=allow, deny=deny)
        return ws

    def create_many(self, count: int, *, image: str = "host", name: str | None = None,
                    memory: str | int | None = "2G", pids: int | None = 512,
                    ttl: float | None = None, network: str | None = None, allow: Sequence[str] = (),
                    deny: Sequence[str] = ()) -> builtins.list[RemoteWorkspace]:
        """``count`` new workspaces: all of them or none."""
        req = m.build(m.CreateWorkspace, image=image, name=name, memory=memory, pids=pids, count=count, ttl=ttl,
                      network=network, allow=list(allow), deny=list(deny))
        r = self.request("POST", "/v1/workspaces", json=req.model_dump(mode="json"), default_wait=False,
                         idempotent=True)
        return [RemoteWorkspace(self, m.WorkspaceOut.model_validate(w)) for w in r.json()]

    def get(self, ref: str) -> RemoteWorkspace:
        """The server's workspace ``ref`` (an id or a name)."""
        return RemoteWorkspace(self, m.WorkspaceOut.model_validate(self.request("GET", f"/v1/workspaces/{ref}").json()))

    def list(self) -> list[m.WorkspaceOut]:
        """The server's workspaces."""
        return [m.WorkspaceOut.model_validate(w) for w in self.request("GET", "/v1/workspaces").json()]

    def snapshot(self, ref: str) -> RemoteSnapshot:
        """The server's snapshot ``ref``."""
        out = m.SnapshotOut.model_validate(self.request("GET", f"/v1/snapshots/{ref}").json())
        return RemoteSnapshot(self, out)

    def snapshots(self) -> builtins.list[RemoteSnapshot]:
        """The server's snapshots."""
        return [RemoteSnapshot(self, m.SnapshotOut.model_validate(s))
                for s in self.request("GET", "/v1/snapshots").json()]

    def load_snapshot(self, folder: str | Path, *, ttl: float | None = None) -> RemoteSnapshot:
        """Upload a folder :meth:`RemoteSnapshot.save` (or ``bunshin snapshot save``) wrote;
        the server takes it if it was saved by a home holding its ``snapshot.key``.
        ``ttl``: its lease in seconds (the server removes it then unless renewed:
        :meth:`RemoteSnapshot.set_ttl`)."""
        src = Path(folder)
        if not (src / MANIFEST).is_file():
            raise InvalidArgument(f"{src} holds no saved snapshot", hint="give a folder a snapshot was saved into")
        try:
            r = self._http.post("/v1/snapshots/load", content=tar_chunks(src), headers={"Content-Type": MEDIA_TYPE},
                                params={} if ttl is None else {"ttl": ttl},
                                timeout=httpx.Timeout(self.timeout, connect=10.0))
        except httpx.TransportError as exc:
            raise _unreachable("POST", f"{self.url}/v1/snapshots/load", self.timeout, exc) from None
        if r.status_code >= 400:
            raise _error_of(r)
        return RemoteSnapshot(self, m.SnapshotOut.model_validate(r.json()))

    def group(self, *, key: str, n: int = 1, image: str | None = None, snapshot: str | None = None,
              task: TaskLike | None = None, tools: builtins.list[str] | None = None,
              speculation: bool = True) -> RemoteGroup:
        """``n`` new trajectories of the group ``key``, on the host's shared prefix cache; the
        first caller of the key (from any process) builds its root from exactly one of
        ``image``, ``snapshot`` or ``task`` (see :mod:`bunshin.client.groups`)."""
        return join(self, key=key, n=n, image=image, snapshot=snapshot, task=task, tools=tools,
                    speculation=speculation)

    def rollouts(self, task: TaskLike, n: int, *, base_url: str, model: str, api_key: str | None = None,
                 mode: str = "bunshin", speculation: bool = True, **policy: Any) -> r.RolloutsOut:
        """A whole group of ``n`` trajectories of ``task`` run on the host against the
        OpenAI-compatible endpoint ``base_url`` (called from the host); its rows."""
        task_json = task.model_dump(mode="json") if hasattr(task, "model_dump") else dict(task)
        req = m.build(r.RunRollouts, task=task_json, n=n, mode=mode, speculation=speculation,
                      policy={"base_url": base_url, "model": model, "api_key": api_key, **policy})
        resp = self.request("POST", "/v1/rollouts", json=req.model_dump(mode="json"), default_wait=False)
        return r.RolloutsOut.model_validate(resp.json())

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connections (the server's workspaces stay)."""
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.url!r})"


def _conforms(client: Client) -> HostAPI:
    """Never called: mypy checks here that a server is a host workspaces are made on."""
    return client


def _unreachable(method: str, url: str, timeout: float | None, exc: httpx.TransportError) -> Unreachable:
    if isinstance(exc, httpx.TimeoutException):
        return Unreachable(f"{method} {url}: no answer within {timeout} s ({exc})",
                           hint="the call may still be running on the server")
    return Unreachable(f"{method} {url}: {exc}",
                       hint="is `bunshin serve` running there? (GET /v1/health needs no token)")


def _retry_after(r: httpx.Response, err: BunshinError, idempotent: bool) -> float | None:
    """Seconds to wait before sending ``r``'s call again, or None: do not."""
    if not (isinstance(err, RateLimited) or (idempotent and isinstance(err, RequestInProgress))):
        return None
    given = err.details.get("retry_after", r.headers.get("retry-after"))
    try:
        return max(0.0, float(given))
    except (TypeError, ValueError):
        return 1.0


def _error_of(r: httpx.Response) -> BunshinError:
    try:
        body = m.ErrorOut.model_validate(r.json())
    except ValueError:
        return BunshinError(f"HTTP {r.status_code} from {r.request.method} {r.request.url}: {r.text[:500]}",
                            hint="not a bunshin server answer: check the URL")
    return BunshinError.from_dict(body.model_dump())
