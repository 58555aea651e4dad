"""Routes that move snapshots between hosts: save one as a tar stream, load one from a tar.

``GET /v1/snapshots/{id}/archive`` saves the snapshot (:meth:`Snapshot.save`: images,
memory files, layers, a manifest signed with this home's key) into a folder under
``home/transfers`` and streams it as an uncompressed tar, then removes the folder.
``POST /v1/snapshots/load`` takes such a tar as the body, unpacks it there with
Python's ``data`` extraction filter (no absolute names, no ``..``, no links out, no
device nodes: the body is untrusted) and loads it with :meth:`Snapshot.load`, which
takes only a folder this home (or a home sharing its ``snapshot.key``) saved,
unchanged. Nothing is left behind, also when the caller leaves mid-transfer.
"""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ..api import models as m
from ..api.archive import MEDIA_TYPE, tar_chunks, untar
from ..workspace import Snapshot
from .context import ServerContext, snapshot_out


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    config = ctx.config

    def scratch(what: str) -> Path:
        root = config.paths.transfers
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return root / f"{what}-{secrets.token_hex(8)}"

    @r.get("/snapshots/{snap_id}/archive", response_class=StreamingResponse,
           responses={200: {"content": {MEDIA_TYPE: {}}}})
    def archive(snap_id: str) -> StreamingResponse:
        snap = Snapshot.get(snap_id, config=config)
        folder = scratch("out")
        try:
            snap.save(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return StreamingResponse(tar_chunks(folder, remove=True), media_type=MEDIA_TYPE,
                                 headers={"Content-Disposition": f'attachment; filename="{snap.id}.tar"'})

    @r.post("/snapshots/load", status_code=201)
    async def load(request: Request) -> m.SnapshotOut:
        spool = scratch("in").with_suffix(".tar")
        folder = spool.with_suffix("")
        try:
            with open(spool, "xb") as f:
                async for chunk in request.stream():
                    await anyio.to_thread.run_sync(f.write, chunk)
            snap = await anyio.to_thread.run_sync(lambda: _unpack_and_load(ctx, spool, folder))
            return snapshot_out(snap)
        finally:
            spool.unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)

    return r


def _unpack_and_load(ctx: ServerContext, spool: Path, folder: Path) -> Snapshot:
    untar(spool, folder)
    return Snapshot.load(folder, config=ctx.config)
