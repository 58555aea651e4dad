"""Routes that move snapshots between hosts: save one as a tar stream, load one from a tar.

``GET /v1/snapshots/{id}/archive`` saves the snapshot (:meth:`Snapshot.save`: images,
memory files, layers, a manifest signed with this home's key) into a folder under
``home/transfers`` (named after the server's pid, so ``bunshin gc`` can tell a dead
server's leftovers) and streams it as an uncompressed tar, then removes the folder.
``POST /v1/snapshots/load`` takes such a tar as the body, unpacks it there with
Python's ``data`` extraction filter (no absolute names, no ``..``, no links out, no
device nodes: the body is untrusted) and loads it with :meth:`Snapshot.load`, which
takes only a folder this home (or a home sharing its ``snapshot.key``) saved,
unchanged. Nothing is left behind, also when the caller leaves mid-transfer.

An upload is bounded by the server's one budget for all uploads in flight (:class:`Uploads`:
``Limits.max_upload``, ``bunshin serve --max-upload``, and the space the home's disk has;
the spool and its unpacked copy coexist, so a body needs twice its size free). A declared
``Content-Length`` over it is refused before a byte is read; a body that grows past it is
cut off there (413, 429 or 507), and what it wrote is removed.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from ..api import models as m
from ..api.archive import MEDIA_TYPE, tar_chunks, untar
from ..workspace import Snapshot
from .context import RAW_BODY, ServerContext, snapshot_out


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    config = ctx.config

    def scratch(what: str) -> Path:
        root = config.paths.transfers
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        return root / f"{what}-{os.getpid()}-{secrets.token_hex(8)}"  # gc: its server's pid

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

    @r.post("/snapshots/load", status_code=201, max_body_size=RAW_BODY)
    async def load(request: Request,
                   ttl: Annotated[float | None, Query(gt=0, le=m.MAX_TTL_S)] = None) -> m.SnapshotOut:
        """``ttl``: the loaded snapshot's lease (renewed with ``PUT /v1/snapshots/{id}/ttl``)."""
        spool = scratch("in").with_suffix(".tar")
        folder = spool.with_suffix("")
        try:
            with ctx.uploads.open(spool.parent, what="snapshot", factor=2) as budget:
                declared = request.headers.get("content-length")
                if declared is not None and declared.isdigit():
                    budget.check(int(declared))
                with open(spool, "xb") as f:
                    async for chunk in request.stream():
                        budget.check(f.tell() + len(chunk))
                        await anyio.to_thread.run_sync(f.write, chunk)
                snap = await anyio.to_thread.run_sync(lambda: _unpack_and_load(ctx, spool, folder))
            if ttl is not None:  # before the answer: a caller that dies now still leaves it leased
                await anyio.to_thread.run_sync(lambda: ctx.snapshot_leases.grant([snap.id], ttl))
            return snapshot_out(snap)
        finally:
            spool.unlink(missing_ok=True)
            shutil.rmtree(folder, ignore_errors=True)

    return r


def _unpack_and_load(ctx: ServerContext, spool: Path, folder: Path) -> Snapshot:
    untar(spool, folder)
    return Snapshot.load(folder, config=ctx.config)
