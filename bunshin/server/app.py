"""The FastAPI application: workspaces, snapshots, commands, sessions, files over HTTP.

Every route but ``GET /v1/health`` needs ``Authorization: Bearer <token>``. Routes are
plain (blocking) functions: FastAPI runs them in its thread pool, widened at start.
Calls into one workspace that talk to its agent or dump it take that workspace's lock,
so a fork never meets a command in flight (the dump would fail on the open
connection); ``DELETE`` does not wait for it. Errors answer with bunshin's code,
message, hint and details and its HTTP status; bad requests are ``invalid_argument``
with status 422 and the fields at fault.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Annotated, Any, TypeVar

import anyio.to_thread
from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .. import __version__
from ..api import models as m
from ..config import Config
from ..errors import BunshinError, InvalidArgument, Unauthorized
from ..workspace import Snapshot, Workspace

T = TypeVar("T")
#: Threads for blocking routes: each command, fork or session run in flight holds one.
THREADS = 256
#: Largest file body a PUT takes.
MAX_FILE_BYTES = 1 << 30


PathQ = Annotated[str, Query(min_length=1, description="a path inside the workspace")]
ModeQ = Annotated[int | None, Query(ge=0, le=0o7777, description="file mode bits")]


class _Locks:
    """One lock per workspace id, made on first use."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    @contextmanager
    def held(self, ws_id: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(ws_id, threading.Lock())
        with lock:
            yield

    def drop(self, ws_id: str) -> None:
        with self._guard:
            self._locks.pop(ws_id, None)


def _workspace_out(ws: Workspace) -> m.WorkspaceOut:
    i = ws.info()
    return m.WorkspaceOut(id=i.id, name=i.name, image=i.image, state=i.state, pid=i.pid,
                          created_at=i.created_at, parent=i.parent, memory_limit=i.memory_limit,
                          pids_limit=i.pids_limit)


def _snapshot_out(s: Snapshot) -> m.SnapshotOut:
    r = s.record
    return m.SnapshotOut(id=s.id, source=r.source, mode=r.mode, created_at=r.created_at, depth=r.depth,
                         pause_ms=r.pause_ms, size_bytes=s.size_bytes)


def _error(exc: BunshinError) -> JSONResponse:
    body = m.ErrorOut(code=exc.code, message=exc.message, hint=exc.hint, details=exc.details)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
    return JSONResponse(body.model_dump(), status_code=exc.http_status, headers=headers)


def create_app(config: Config, token: str) -> FastAPI:
    """The app serving ``config``'s workspaces to callers holding ``token``."""
    locks = _Locks()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        yield

    app = FastAPI(title="bunshin", version=__version__, lifespan=lifespan)

    @app.exception_handler(BunshinError)
    async def _bunshin_error(_: Request, exc: BunshinError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        err = InvalidArgument("invalid request: " + "; ".join(problems), hint="see /docs for the request shapes")
        return JSONResponse(m.ErrorOut(code=err.code, message=err.message, hint=err.hint).model_dump(),
                            status_code=422)

    def authorized(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("missing or wrong API token",
                               hint="send 'Authorization: Bearer <token>' (the token is in the server's "
                                    "token file, e.g. BUNSHIN_HOME/server.token)")

    auth = [Depends(authorized)]

    def ws_of(ws_id: str) -> Workspace:
        return Workspace.get(ws_id, config=config)

    def locked(ws_id: str, fn: Callable[[Workspace], T]) -> T:
        ws = ws_of(ws_id)
        with locks.held(ws.id):
            return fn(ws)

    @app.get("/v1/health")
    def health() -> m.Health:
        return m.Health(ok=True, version=__version__)

    # --- workspaces -------------------------------------------------------------------

    @app.post("/v1/workspaces", dependencies=auth, status_code=201)
    def create(req: m.CreateWorkspace) -> list[m.WorkspaceOut]:
        made: list[Workspace] = []
        try:
            for i in range(req.count):
                name = req.name if req.count == 1 or req.name is None else f"{req.name}-{i}"
                made.append(Workspace.create(req.image, name=name, memory=req.memory, pids=req.pids,
                                             config=config))
        except BaseException:
            for ws in made:  # all or none
                ws.remove()
            raise
        return [_workspace_out(ws) for ws in made]

    @app.get("/v1/workspaces", dependencies=auth)
    def list_workspaces() -> list[m.WorkspaceOut]:
        return [m.WorkspaceOut(id=i.id, name=i.name, image=i.image, state=i.state, pid=i.pid,
                               created_at=i.created_at, parent=i.parent, memory_limit=i.memory_limit,
                               pids_limit=i.pids_limit) for i in Workspace.list(config=config)]

    @app.get("/v1/workspaces/{ws_id}", dependencies=auth)
    def get_workspace(ws_id: str) -> m.WorkspaceOut:
        return _workspace_out(ws_of(ws_id))

    @app.delete("/v1/workspaces/{ws_id}", dependencies=auth, status_code=204)
    def remove(ws_id: str) -> Response:
        ws = ws_of(ws_id)
        ws.remove()
        locks.drop(ws.id)
        return Response(status_code=204)

    @app.post("/v1/workspaces/{ws_id}/fork", dependencies=auth)
    def fork(ws_id: str, req: m.ForkRequest) -> m.ForkOut:
        def go(ws: Workspace) -> m.ForkOut:
            clones = ws.fork(req.count, mode=req.mode)
            snap = ws.last_fork
            return m.ForkOut(parent=ws.id, snapshot=snap.id if snap else None,
                             pause_ms=snap.pause_ms if snap else None,
                             forks=[_workspace_out(c) for c in clones])
        return locked(ws_id, go)

    @app.post("/v1/workspaces/{ws_id}/snapshots", dependencies=auth, status_code=201)
    def take_snapshot(ws_id: str, req: m.TakeSnapshot) -> m.SnapshotOut:
        return locked(ws_id, lambda ws: _snapshot_out(ws.snapshot(mode=req.mode)))

    @app.put("/v1/workspaces/{ws_id}/cpu-priority", dependencies=auth, status_code=204)
    def cpu_priority(ws_id: str, req: m.Priority) -> Response:
        ws_of(ws_id).set_cpu_priority(req.nice)
        return Response(status_code=204)

    @app.get("/v1/workspaces/{ws_id}/stats", dependencies=auth)
    def stats(ws_id: str) -> m.StatsOut:
        return m.StatsOut.of(ws_of(ws_id).stats())

    @app.get("/v1/workspaces/{ws_id}/processes", dependencies=auth)
    def processes(ws_id: str) -> list[m.ProcessOut]:
        return locked(ws_id, lambda ws: [m.ProcessOut.of(p) for p in ws.processes()])

    # --- commands and sessions ----------------------------------------------------------

    @app.post("/v1/workspaces/{ws_id}/exec", dependencies=auth)
    def run(ws_id: str, req: m.ExecRequest) -> m.ExecOut:
        def go(ws: Workspace) -> m.ExecOut:
            kw: dict[str, Any] = {"timeout": req.timeout, "cwd": req.cwd, "env": req.env, "stdin": req.stdin,
                                  "max_output": req.max_output}
            if req.text:
                return m.ExecOut.of(ws.commands.run(req.command, **kw))
            return m.ExecOut.of(ws.commands.run(req.command, text=False, **kw))
        return locked(ws_id, go)

    @app.post("/v1/workspaces/{ws_id}/spawn", dependencies=auth)
    def spawn(ws_id: str, req: m.SpawnRequest) -> m.SpawnOut:
        return locked(ws_id, lambda ws: m.SpawnOut(pid=ws.commands.spawn(req.command, cwd=req.cwd, env=req.env)))

    @app.get("/v1/workspaces/{ws_id}/sessions", dependencies=auth)
    def sessions(ws_id: str) -> list[m.SessionOut]:
        return locked(ws_id, lambda ws: [m.SessionOut.of(s) for s in ws.sessions.list()])

    @app.post("/v1/workspaces/{ws_id}/sessions", dependencies=auth, status_code=201)
    def open_session(ws_id: str, req: m.OpenSession) -> m.OpenedSession:
        return locked(ws_id, lambda ws: m.OpenedSession(
            session_id=ws.sessions.open(req.kind, cwd=req.cwd, env=req.env)))

    @app.post("/v1/workspaces/{ws_id}/sessions/{sid}/run", dependencies=auth)
    def run_in_session(ws_id: str, sid: str, req: m.RunInSession) -> m.SessionRunOut:
        return locked(ws_id, lambda ws: m.SessionRunOut.of(
            ws.sessions.run(sid, req.command, timeout=req.timeout, max_output=req.max_output)))

    @app.delete("/v1/workspaces/{ws_id}/sessions/{sid}", dependencies=auth, status_code=204)
    def close_session(ws_id: str, sid: str) -> Response:
        locked(ws_id, lambda ws: ws.sessions.close(sid))
        return Response(status_code=204)

    # --- files ----------------------------------------------------------------------------

    @app.get("/v1/workspaces/{ws_id}/files", dependencies=auth)
    def list_files(ws_id: str, path: PathQ) -> list[m.FileOut]:
        return locked(ws_id, lambda ws: [m.FileOut.of(e) for e in ws.files.list(path)])

    @app.get("/v1/workspaces/{ws_id}/files/content", dependencies=auth)
    def read_file(ws_id: str, path: PathQ) -> Response:
        data = locked(ws_id, lambda ws: ws.files.read(path))
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/workspaces/{ws_id}/files/content", dependencies=auth)
    async def write_file(ws_id: str, path: PathQ, request: Request,
                         mode: ModeQ = None) -> m.Written:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FILE_BYTES:
                raise InvalidArgument(f"file body over {MAX_FILE_BYTES} bytes", hint="write it in parts")
        n = await anyio.to_thread.run_sync(lambda: locked(ws_id, lambda ws: ws.files.write(path, bytes(body),
                                                                                           mode=mode)))
        return m.Written(bytes=n)

    @app.delete("/v1/workspaces/{ws_id}/files", dependencies=auth, status_code=204)
    def remove_file(ws_id: str, path: PathQ, recursive: bool = False) -> Response:
        locked(ws_id, lambda ws: ws.files.remove(path, recursive=recursive))
        return Response(status_code=204)

    # --- snapshots ------------------------------------------------------------------------

    @app.get("/v1/snapshots", dependencies=auth)
    def list_snapshots() -> list[m.SnapshotOut]:
        return [_snapshot_out(s) for s in Snapshot.list(config=config)]

    @app.get("/v1/snapshots/{snap_id}", dependencies=auth)
    def get_snapshot(snap_id: str) -> m.SnapshotOut:
        return _snapshot_out(Snapshot.get(snap_id, config=config))

    @app.post("/v1/snapshots/{snap_id}/restore", dependencies=auth, status_code=201)
    def restore(snap_id: str, req: m.RestoreRequest) -> list[m.WorkspaceOut]:
        return [_workspace_out(w) for w in Snapshot.get(snap_id, config=config).restore(req.count)]

    @app.delete("/v1/snapshots/{snap_id}", dependencies=auth, status_code=204)
    def remove_snapshot(snap_id: str) -> Response:
        Snapshot.get(snap_id, config=config).remove()
        return Response(status_code=204)

    return app
