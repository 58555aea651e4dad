"""envd's HTTP routes (``spec/envd/envd.yaml``): ``GET /files`` (download), ``POST /files``
(upload: ``application/octet-stream`` with ``?path=``, or ``multipart/form-data`` with one
``file`` part per file, named by its path, or written to ``?path=`` if given, as envd does:
what a signed upload URL names), ``GET /envs`` and ``GET /metrics``.
``/health`` is answered before the access token is checked, as envd's is.

Errors are envd's ``{"code": <status>, "message"}``. A download streams in pieces of
``STREAM_CHUNK`` (one held at a time); an upload is spooled within the server's upload
budget, then written, each file at most ``MAX_FILE_BYTES`` (gzip bodies bounded after
decompression), at most ``MAX_FILES`` files a request, a multipart body at most
``MAX_MULTIPART`` bytes whole.
"""

from __future__ import annotations

import base64
import functools
import posixpath
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ....errors import BunshinError, InvalidArgument, PayloadTooLarge
from ...context import MAX_FILE_BYTES, STREAM_CHUNK
from ...uploads import counted, receiving, spooled
from ..sandboxes import sandbox_envs
from . import procs
from .filesystem import resolve
from .rpc import Call, user_of

MAX_FILES = 1000
#: A multipart upload's whole body (its parts are spooled on the host before they are written).
MAX_MULTIPART = MAX_FILE_BYTES
PARTS_HINT = "write it in parts"
MULTIPART_HINT = "upload large files one at a time as application/octet-stream (write them in parts)"


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _status(e: BunshinError) -> int:
    return {"path_not_found": 404, "not_found": 404, "invalid_argument": 400, "payload_too_large": 400,
            "resource_exhausted": 507, "rate_limited": 429}.get(e.code, 500)


def _call(call: Call, request: Request) -> Call:
    """The call as ``?username=`` names its user (the RPCs take ``Authorization`` instead)."""
    name = request.query_params.get("username")
    if not name:
        return call
    user = user_of("Basic " + base64.b64encode(f"{name}:".encode()).decode())
    return Call(call.ctx, call.ws, user)


async def download(call: Call, request: Request) -> Response:
    call = _call(call, request)
    path = resolve(call, request.query_params.get("path", ""))
    e = await procs.run(call, call.ws.agent().stat, path)
    if e.type == "dir":
        return error(400, f"path '{path}' is a directory")
    if e.size > MAX_FILE_BYTES:
        return error(400, f"path '{path}' is over {MAX_FILE_BYTES} bytes")

    async def body() -> AsyncIterator[bytes]:
        offset = 0
        while True:
            piece = await procs.poll(call, call.ws.files.read, path, offset=offset, length=STREAM_CHUNK)
            if not piece:
                return
            offset += len(piece)
            yield piece
            if offset >= MAX_FILE_BYTES:
                return

    name = posixpath.basename(path).replace('"', "")
    return StreamingResponse(body(), media_type="application/octet-stream",
                             headers={"Content-Disposition": f'attachment; filename="{name}"'})


def _info(path: str) -> dict[str, str]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


def _bounded(chunks: Iterator[bytes], gz: bool) -> Iterator[bytes]:
    """``chunks`` (gunzipped if ``gz``), refused past ``MAX_FILE_BYTES``."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gz else None
    total = 0
    for c in chunks:
        out = inflate.decompress(c, STREAM_CHUNK) if inflate else c
        while True:
            total += len(out)
            if total > MAX_FILE_BYTES:
                raise PayloadTooLarge(f"file over {MAX_FILE_BYTES} bytes", hint="write it in parts")
            yield out
            if not inflate or not inflate.unconsumed_tail:
                break
            out = inflate.decompress(inflate.unconsumed_tail, STREAM_CHUNK)


async def upload(call: Call, request: Request) -> Response:
    call = _call(call, request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "multipart/form-data":
        return await _multipart(call, request)
    path = resolve(call, request.query_params.get("path", ""))
    gz = request.headers.get("content-encoding", "").lower() == "gzip"
    # spooled first, then written under the sandbox's lock: a slow client holds neither the
    # lock nor a thread of the server's pool while its body trickles in
    async with spooled(call.ctx.uploads, request, call.ctx.config.paths.transfers, limit=MAX_FILE_BYTES,
                       hint=PARTS_HINT, offload=functools.partial(call.ctx.shares.run, call.ws.id, refuse=False)) as body:
        def write() -> None:
            with call.ctx.locks.held(call.ws):
                call.ws.files.write_stream(path, _bounded(iter(lambda: body.read(STREAM_CHUNK), b""), gz))
                procs.give_to_user(call, path)

        await call.ctx.shares.run(call.ws.id, write)
    return JSONResponse([_info(path)])


async def _multipart(call: Call, request: Request) -> Response:
    """A multipart form is spooled by Starlette before its files are written: the body is
    bounded whole (``MAX_MULTIPART``) and counted with every other upload in flight."""
    with receiving(call.ctx.uploads, request, call.ctx.config.paths.transfers, limit=MAX_MULTIPART,
                   hint=MULTIPART_HINT) as budget:
        return await _multipart_within(call, counted(request, budget))


async def _multipart_within(call: Call, request: Request) -> Response:
    default = request.query_params.get("path")
    form = await request.form(max_files=MAX_FILES, max_fields=MAX_FILES)
    written: list[dict[str, str]] = []
    try:
        for key, part in form.multi_items():
            if key != "file" or isinstance(part, str):
                continue
            path = resolve(call, default or part.filename or "")  # ?path= first: a signed URL's is its one path
            f = part.file

            def chunks(f: Any = f) -> Iterator[bytes]:
                while piece := f.read(STREAM_CHUNK):
                    yield piece

            def write(path: str = path, chunks: Any = chunks) -> None:
                with call.ctx.locks.held(call.ws):
                    call.ws.files.write_stream(path, _bounded(chunks(), False))
                    procs.give_to_user(call, path)

            await call.ctx.shares.run(call.ws.id, write, refuse=not written)  # the first refused, not the rest
            written.append(_info(path))
    finally:
        await form.close()
    if not written:
        raise InvalidArgument("no 'file' part in the upload", hint="send each file as a 'file' part")
    return JSONResponse(written)


async def envs(call: Call, request: Request) -> Response:
    """The sandbox's environment variables (its create's ``envVars``)."""
    return JSONResponse(await call.ctx.shares.run(call.ws.id, sandbox_envs, call.ctx.config, call.ws.id))


async def metrics(call: Call, request: Request) -> Response:
    s = await call.ctx.shares.run(call.ws.id, call.ws.stats)
    used = int(getattr(s.memory, "pss", 0) or 0)
    total = int(call.ws.record.memory_limit or 0)
    return JSONResponse({"ts": int(time.time()), "cpu_count": 1, "cpu_used_pct": 0.0,
                         "mem_total": total, "mem_used": used, "mem_total_mib": total >> 20,
                         "mem_used_mib": used >> 20, "disk_used": 0, "disk_total": 0})


async def answer(call: Call, request: Request) -> Response:
    """The answer to one of envd's HTTP routes (bunshin errors in envd's shape)."""
    route = (request.method, request.url.path)
    handler = {("GET", "/files"): download, ("POST", "/files"): upload, ("GET", "/envs"): envs,
               ("GET", "/metrics"): metrics}.get(route)
    if handler is None:
        return error(404, f"{request.method} {request.url.path} is not a route of bunshin's envd")
    try:
        return await handler(call, request)
    except BunshinError as e:
        return error(_status(e), e.message)
