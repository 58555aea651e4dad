"""Routes of workspaces: create, list, get, remove, fork, snapshot, commands, sessions, files.

Create, fork and snapshot take an ``Idempotency-Key`` (:mod:`.idempotency`); create and
fork pass admission control first (:mod:`.admission`)."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request, Response

from ..api import models as m
from ..errors import InvalidArgument
from ..runtime.cgroups import parse_size
from ..workspace import Workspace
from .context import (
    MAX_FILE_BYTES,
    ModeQ,
    PathQ,
    ServerContext,
    snapshot_out,
)
from .idempotency import IdemKey
from .images import image_id


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    config, locks, ws_of, locked = ctx.config, ctx.locks, ctx.ws_of, ctx.locked
    admission, once = ctx.admission, ctx.idempotency.run

    # --- workspaces -------------------------------------------------------------------

    @r.post("/workspaces", status_code=201, response_model=list[m.WorkspaceOut])
    def create(req: m.CreateWorkspace, key: IdemKey, request: Request) -> Response:
        def go() -> list[m.WorkspaceOut]:
            image = image_id(config, req.image)  # never a host folder; pulled here if need be
            made: list[Workspace] = []
            with admission.admit(req.count, parse_size(req.memory)):
                try:
                    for i in range(req.count):
                        name = req.name if req.count == 1 or req.name is None else f"{req.name}-{i}"
                        made.append(Workspace.create(image, name=name, memory=req.memory, pids=req.pids,
                                                     config=config))
                except BaseException:
                    for ws in made:  # all or none
                        ws.remove()
                    raise
            return ctx.made(request, made, req.ttl)
        return once(key, "POST", "/v1/workspaces", req, 201, go)

    @r.get("/workspaces")
    def list_workspaces() -> list[m.WorkspaceOut]:
        return [ctx.out(i) for i in Workspace.list(config=config)]

    @r.get("/workspaces/{ws_id}")
    def get_workspace(ws_id: str) -> m.WorkspaceOut:
        return ctx.out(ws_of(ws_id))

    @r.delete("/workspaces/{ws_id}", status_code=204)
    def remove(ws_id: str) -> Response:
        ws = ws_of(ws_id)
        ws.remove()
        locks.drop(ws)
        ctx.leases.drop(ws.id)
        return Response(status_code=204)

    @r.put("/workspaces/{ws_id}/ttl")
    def set_ttl(ws_id: str, req: m.SetTTL) -> m.WorkspaceOut:
        ws = ws_of(ws_id)
        ctx.leases.grant([ws.id], req.ttl)
        return ctx.out(ws)

    @r.post("/workspaces/{ws_id}/fork", response_model=m.ForkOut)
    def fork(ws_id: str, req: m.ForkRequest, key: IdemKey, request: Request) -> Response:
        def go(ws: Workspace) -> m.ForkOut:
            with admission.admit(req.count, ws.info().memory_limit):
                clones = ws.fork(req.count, mode=req.mode)
            snap = ws.last_fork
            lease = ctx.leases.get(ws.id)
            ttl = req.ttl if req.ttl is not None else lease.ttl if lease is not None else None
            return m.ForkOut(parent=ws.id, snapshot=snap.id if snap else None,
                             pause_ms=snap.pause_ms if snap else None, forks=ctx.made(request, clones, ttl))
        return once(key, "POST", f"/v1/workspaces/{ws_id}/fork", req, 200, lambda: locked(ws_id, go))

    @r.post("/workspaces/{ws_id}/snapshots", status_code=201, response_model=m.SnapshotOut)
    def take_snapshot(ws_id: str, req: m.TakeSnapshot, key: IdemKey) -> Response:
        return once(key, "POST", f"/v1/workspaces/{ws_id}/snapshots", req, 201,
                    lambda: locked(ws_id, lambda ws: snapshot_out(ws.snapshot(mode=req.mode))))

    @r.put("/workspaces/{ws_id}/cpu-priority", status_code=204)
    def cpu_priority(ws_id: str, req: m.Priority) -> Response:
        ws_of(ws_id).set_cpu_priority(req.nice)
        return Response(status_code=204)

    @r.get("/workspaces/{ws_id}/stats")
    def stats(ws_id: str) -> m.StatsOut:
        return m.StatsOut.of(ws_of(ws_id).stats())

    @r.get("/workspaces/{ws_id}/processes")
    def processes(ws_id: str) -> list[m.ProcessOut]:
        return locked(ws_id, lambda ws: [m.ProcessOut.of(p) for p in ws.processes()])

    # --- commands and sessions ----------------------------------------------------------

    @r.post("/workspaces/{ws_id}/exec")
    def run(ws_id: str, req: m.ExecRequest) -> m.ExecOut:
        def go(ws: Workspace) -> m.ExecOut:
            kw: dict[str, Any] = {"timeout": req.timeout, "cwd": req.cwd, "env": req.env, "stdin": req.stdin,
                                  "max_output": req.max_output}
            if req.text:
                return m.ExecOut.of(ws.commands.run(req.command, **kw))
            return m.ExecOut.of(ws.commands.run(req.command, text=False, **kw))
        return locked(ws_id, go)

    @r.post("/workspaces/{ws_id}/spawn")
    def spawn(ws_id: str, req: m.SpawnRequest) -> m.SpawnOut:
        return locked(ws_id, lambda ws: m.SpawnOut(pid=ws.commands.spawn(req.command, cwd=req.cwd, env=req.env)))

    @r.get("/workspaces/{ws_id}/sessions")
    def sessions(ws_id: str) -> list[m.SessionOut]:
        return locked(ws_id, lambda ws: [m.SessionOut.of(s) for s in ws.sessions.list()])

    @r.post("/workspaces/{ws_id}/sessions", status_code=201)
    def open_session(ws_id: str, req: m.OpenSession) -> m.OpenedSession:
        return locked(ws_id, lambda ws: m.OpenedSession(
            session_id=ws.sessions.open(req.kind, cwd=req.cwd, env=req.env)))

    @r.post("/workspaces/{ws_id}/sessions/{sid}/run")
    def run_in_session(ws_id: str, sid: str, req: m.RunInSession) -> m.SessionRunOut:
        return locked(ws_id, lambda ws: m.SessionRunOut.of(
            ws.sessions.run(sid, req.command, timeout=req.timeout, max_output=req.max_output)))

    @r.delete("/workspaces/{ws_id}/sessions/{sid}", status_code=204)
    def close_session(ws_id: str, sid: str) -> Response:
        locked(ws_id, lambda ws: ws.sessions.close(sid))
        return Response(status_code=204)

    # --- files ----------------------------------------------------------------------------

    @r.get("/workspaces/{ws_id}/files")
    def list_files(ws_id: str, path: PathQ) -> list[m.FileOut]:
        return locked(ws_id, lambda ws: [m.FileOut.of(e) for e in ws.files.list(path)])

    @r.get("/workspaces/{ws_id}/files/content")
    def read_file(ws_id: str, path: PathQ) -> Response:
        data = locked(ws_id, lambda ws: ws.files.read(path))
        return Response(data, media_type="application/octet-stream")

    @r.put("/workspaces/{ws_id}/files/content")
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

    @r.delete("/workspaces/{ws_id}/files", status_code=204)
    def remove_file(ws_id: str, path: PathQ, recursive: bool = False) -> Response:
        locked(ws_id, lambda ws: ws.files.remove(path, recursive=recursive))
        return Response(status_code=204)

    return r
