"""Routes of snapshots: list, get, restore (idempotent, admitted like a create), remove."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..api import models as m
from ..workspace import Snapshot
from .context import ServerContext, snapshot_out
from .idempotency import IdemKey


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    config = ctx.config

    # --- snapshots ------------------------------------------------------------------------

    @r.get("/snapshots")
    def list_snapshots() -> list[m.SnapshotOut]:
        return [snapshot_out(s) for s in Snapshot.list(config=config)]

    @r.get("/snapshots/{snap_id}")
    def get_snapshot(snap_id: str) -> m.SnapshotOut:
        return snapshot_out(Snapshot.get(snap_id, config=config))

    @r.post("/snapshots/{snap_id}/restore", status_code=201, response_model=list[m.WorkspaceOut])
    def restore(snap_id: str, req: m.RestoreRequest, key: IdemKey, request: Request) -> Response:
        def go() -> list[m.WorkspaceOut]:
            snap = Snapshot.get(snap_id, config=config)
            with ctx.admission.admit(req.count, snap.record.memory_limit, snap.record.pids_limit):
                made = snap.restore(req.count)
            return ctx.made(request, made, req.ttl)
        return ctx.idempotency.run(key, "POST", f"/v1/snapshots/{snap_id}/restore", req, 201, go)

    @r.put("/snapshots/{snap_id}/ttl")
    def set_snapshot_ttl(snap_id: str, req: m.SetTTL) -> m.SnapshotOut:
        """Lease the snapshot for ``ttl`` more seconds (``null``: until removed)."""
        snap = Snapshot.get(snap_id, config=config)
        ctx.snapshot_leases.grant([snap.id], req.ttl)
        return snapshot_out(snap)

    @r.delete("/snapshots/{snap_id}", status_code=204)
    def remove_snapshot(snap_id: str) -> Response:
        Snapshot.get(snap_id, config=config).remove()
        ctx.snapshot_leases.drop(snap_id)
        return Response(status_code=204)

    return r
