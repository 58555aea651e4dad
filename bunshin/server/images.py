"""The images a remote caller may name: ``host`` or a stored (or pullable) image, never a folder;
and the routes that move stored images between hosts by digest (``router``).

A host folder as a root filesystem is a local choice of whoever runs bunshin on the host;
over HTTP a name that could be a folder (``/x``, ``./x``, or one that is not a reference)
is refused, and a reference is turned into the stored image's id (``sha256:...``) before
anything uses it, so no folder of the server's, relative to wherever it runs, can stand in.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio.from_thread
import anyio.to_thread
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from ..api.images import DIGEST_HEADER, MAC_HEADER, MEDIA_TYPE, SIZE_HEADER, ImageOut, LayerOut
from ..api.models import served_image
from ..config import Config
from ..errors import ImageNotFound, InvalidArgument, PayloadTooLarge
from ..runtime.container import images
from ..runtime.oci import exchange, layer_tar
from ..runtime.oci import store as oci_store
from ..runtime.oci.records import ImageRecord
from ..runtime.state.store import Store
from .context import RAW_BODY, CallerGone, ServerContext
from .uploads import UploadBudget

HINT = "'host', or an image reference the host holds or can pull (`bunshin image ls` on the host)"


def check_image(image: str, field: str = "image") -> None:
    """Refuse what is not 'host' or an image reference (``InvalidArgument`` naming ``field``)."""
    try:
        served_image(image)
    except ValueError as e:
        raise InvalidArgument(f"{field}: {e}", field=field, hint=HINT) from None


def image_id(config: Config, image: str, field: str = "image") -> str:
    """'host', or the id of the stored image ``image`` names (pulled first if the store lacks it
    and the reference names its registry)."""
    check_image(image, field)
    if image == images.HOST:
        return image
    with Store.open(config.db_path) as store:
        return images.stored_image(config, store, image).id


# ------------------------------------------------------------------ routes: images by digest

#: A manifest is a few KiB per layer; anything past this is refused unread.
MAX_MANIFEST = 8 << 20


def router(ctx: ServerContext) -> APIRouter:
    """``GET /v1/images``, ``GET``/``HEAD``/``PUT /v1/images/{ref}``, ``GET /v1/images/{ref}/manifest``
    and ``GET``/``PUT /v1/images/{id}/layers/{diff_id}`` (see ``bunshin.api.images``)."""
    r = APIRouter(prefix="/v1")
    config = ctx.config

    def out(store: Store, rec: ImageRecord) -> ImageOut:
        return ImageOut(id=rec.id, names=list(rec.names), digests=list(rec.digests), layers=list(rec.layers),
                        size_bytes=rec.size_bytes, created_at=rec.created_at,
                        missing=exchange.missing(config, store, rec))

    @r.get("/images")
    def list_images() -> list[ImageOut]:
        with Store.open(config.db_path) as store:
            return [out(store, rec) for rec in oci_store.list_images(store)]

    @r.get("/images/{image_id}/layers/{diff_id}", response_class=StreamingResponse,
           responses={200: {"content": {MEDIA_TYPE: {}}}})
    def get_layer(image_id: str, diff_id: str) -> StreamingResponse:
        with Store.open(config.db_path) as store:
            rec = oci_store.find(store, image_id)
            if diff_id not in rec.layers or oci_store.stored_layer_size(config, store, diff_id) is None:
                raise ImageNotFound(f"image {rec.short_id} has no layer {diff_id} here",
                                    hint="GET /v1/images/{id}/manifest lists its layers")
            t = layer_tar.describe(config, store, diff_id)
        return StreamingResponse(layer_tar.chunks(config, diff_id), media_type=MEDIA_TYPE,
                                 headers={"Content-Length": str(t.size), DIGEST_HEADER: t.digest,
                                          SIZE_HEADER: str(t.size)})

    @r.put("/images/{image_id}/layers/{diff_id}", max_body_size=RAW_BODY)
    async def put_layer(image_id: str, diff_id: str, request: Request) -> LayerOut:
        h = request.headers
        size = h.get(SIZE_HEADER, "")
        entry = exchange.check_entry({"diff_id": diff_id, "digest": h.get(DIGEST_HEADER),
                                      "size": int(size) if size.isdigit() else None, "mac": h.get(MAC_HEADER)})
        config.paths.image_staging.mkdir(parents=True, exist_ok=True)
        with ctx.uploads.open(config.paths.image_staging, what="image layer") as budget:  # unpacked as it comes
            declared = h.get("content-length")
            budget.check(int(declared) if declared and declared.isdigit() else entry.size)
            body = io.BufferedReader(_Body(request.stream().__aiter__(), budget), 1 << 20)

            def go() -> LayerOut:
                with Store.open(config.db_path) as store:
                    done = exchange.import_layer(config, store, image_id, entry, body)
                return LayerOut(diff_id=done.diff_id, bytes_read=done.bytes_read, skipped=done.skipped)

            return await anyio.to_thread.run_sync(go)

    @r.get("/images/{ref:path}/manifest")
    def get_manifest(ref: str) -> dict[str, Any]:
        with Store.open(config.db_path) as store:
            return exchange.manifest(config, store, ref)

    @r.head("/images/{ref:path}")
    def head_image(ref: str) -> Response:
        with Store.open(config.db_path) as store:
            rec = oci_store.find(store, ref)
            lacking = exchange.missing(config, store, rec)
        if lacking:
            raise ImageNotFound(f"image {rec.short_id} lacks {len(lacking)} of its layers here")
        return Response(status_code=200, headers={"X-Bunshin-Image-Id": rec.id})

    @r.get("/images/{ref:path}")
    def get_image(ref: str) -> ImageOut:
        with Store.open(config.db_path) as store:
            return out(store, oci_store.find(store, ref))

    @r.put("/images/{image_id}")
    async def put_image(image_id: str, request: Request) -> ImageOut:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_MANIFEST:
                raise PayloadTooLarge(f"an image manifest is at most {MAX_MANIFEST} bytes",
                                      hint="send the manifest GET /v1/images/{id}/manifest answered")
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise InvalidArgument(f"the image manifest is not JSON ({e})",
                                  hint="send the manifest GET /v1/images/{id}/manifest answered") from None
        if not isinstance(doc, dict) or doc.get("id") != image_id:
            raise InvalidArgument(f"the manifest is not that of image {image_id}",
                                  hint="PUT it to /v1/images/{the id it names}")

        def go() -> ImageOut:
            with Store.open(config.db_path) as store:
                rec, _ = exchange.import_image(config, store, doc)
                return out(store, rec)

        return await anyio.to_thread.run_sync(go)

    return r


class _Body(io.RawIOBase):
    """A request body read from a worker thread (``anyio.from_thread``), within its budget."""

    def __init__(self, chunks: AsyncIterator[bytes], budget: UploadBudget) -> None:
        self.chunks, self.budget = chunks, budget
        self.buf = b""
        self.seen = 0

    def readable(self) -> bool:
        return True

    async def _next(self) -> bytes:
        try:
            return await self.chunks.__anext__()
        except ClientDisconnect:
            raise CallerGone("the caller left in the middle of a layer upload: nothing was stored") from None

    def readinto(self, b: Any) -> int:
        while not self.buf:
            try:
                chunk = anyio.from_thread.run(self._next)
            except StopAsyncIteration:
                return 0
            self.seen += len(chunk)
            self.budget.check(self.seen)
            self.buf = chunk
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n
