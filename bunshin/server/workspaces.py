"""Routes of workspaces: create, list, get, remove, fork, snapshot, commands, sessions, files.

Create, fork and snapshot take an ``Idempotency-Key`` (:mod:`.idempotency`); create and
fork pass admission control first (:mod:`.admission`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from ..api import models as m
from ..runtime.container.cgroups import parse_size
from ..workspace import Workspace
from .context import (
    MAX_FILE_BYTES,
    RAW_BODY,
    STREAM_CHUNK,
    LengthQ,
    ModeQ,
    OffsetQ,
    PathQ,
    ServerContext,
    snapshot_out,
)
from .idempotency import IdemKey
from .images import image_id
from .network import publish_all
from .uploads import spooled

#: What to do with a file body over ``MAX_FILE_BYTES``.
PUT_HINT = "write it in parts, or copy it in as a tar and unpack it inside"


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    config, locks, ws_of, locked = ctx.config, ctx.locks, ctx.ws_of, ctx.locked
    admission, once = ctx.admission, ctx.idempotency.run

    # --- workspaces -------------------------------------------------------------------

    @r.post("/workspaces", status_code=201, response_model=list[m.WorkspaceOut])
    def create(req: m.CreateWorkspace, key: IdemKey, request: Request) -> Response:
        def go() -> list[m.WorkspaceOut]:
            image = image_id(config, req.image)  # never a host folder; pulled here if need be
            network = ctx.network_mode(req.network)
            made: list[Workspace] = []
            ports: list[list[m.PortOut]] = []
            with admission.admit(req.count, parse_size(req.memory), req.pids):
                try:
                    for i in range(req.count):
                        name = req.name if req.count == 1 or req.name is None else f"{req.name}-{i}"
                        made.append(Workspace.create(image, name=name, memory=req.memory, pids=req.pids,
                                                     config=config, network=network, allow=req.allow, deny=req.deny))
                        ports.append(publish_all(made[-1], req.publish))
                except BaseException:
                    for ws in made:  # all or none
                        ws.remove()
                    raise
            out = ctx.made(request, made, req.ttl)
            return [o.model_copy(update={"ports": p}) for o, p in zip(out, ports, strict=True)] if req.publish else out
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
            with admission.admit(req.count, ws.info().memory_limit, ws.info().pids_limit):
                clones = ws.fork(req.count, mode=req.mode)
            snap = ws.last_fork
            lease = ctx.leases.get(ws.id)
            ttl = req.ttl if req.ttl is not None else lease.ttl if lease is not None else None
            t = clones.timings
            return m.ForkOut(parent=ws.id, snapshot=snap.id if snap else None,
                             pause_ms=snap.pause_ms if snap else None, forks=ctx.made(request, clones, ttl),
                             mode=t.mode, dump_ms=t.dump_ms, rewrite_ms=t.rewrite_ms,
                             memfile_bytes=t.memfile_bytes, restore_ms=list(t.restore_ms))
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

    @r.get("/workspaces/{ws_id}/files/content", response_class=StreamingResponse,
           responses={200: {"content": {"application/octet-stream": {}}}})
    def read_file(ws_id: str, path: PathQ, offset: OffsetQ = 0, length: LengthQ = None) -> StreamingResponse:
        """The file's bytes from ``offset`` (at most ``length``), streamed a piece at a time under
        the workspace's lock; a whole file over ``MAX_FILE_BYTES`` is refused (413) unread."""
        ws = ws_of(ws_id)
        pieces = ws.files.stream(path, offset=offset, length=length, chunk=STREAM_CHUNK)

        def piece() -> bytes:
            with locks.held(ws):
                return next(pieces, b"")

        first = piece()  # a missing file, or one too large: the error answers now, before the body

        def rest() -> Iterator[bytes]:
            yield first
            while more := piece():
                yield more

        return StreamingResponse(rest(), media_type="application/octet-stream")

    @r.put("/workspaces/{ws_id}/files/content", max_body_size=RAW_BODY)
    async def write_file(ws_id: str, path: PathQ, request: Request,
                         mode: ModeQ = None) -> m.Written:
        """The body is spooled (a MiB in memory, the rest on the home's disk, within the server's
        upload budget), then written a piece at a time under the workspace's lock: the file
        changes only once the whole body is here."""
        async with spooled(ctx.uploads, request, config.paths.transfers, limit=MAX_FILE_BYTES, hint=PUT_HINT) as body:
            def go(ws: Workspace) -> int:
                return ws.files.write_stream(path, iter(lambda: body.read(STREAM_CHUNK), b""), mode=mode)

            n = await anyio.to_thread.run_sync(lambda: locked(ws_id, go))
        return m.Written(bytes=n)

    @r.delete("/workspaces/{ws_id}/files", status_code=204)
    def remove_file(ws_id: str, path: PathQ, recursive: bool = False) -> Response:
        locked(ws_id, lambda ws: ws.files.remove(path, recursive=recursive))
        return Response(status_code=204)

    return r

