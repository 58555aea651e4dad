"""Typed responses of the image routes (pydantic), shared by server and client.

An image moves between hosts by digest (``bunshin.runtime.oci.exchange``): the holder's
signed manifest (``GET /v1/images/{ref}/manifest``, a JSON object passed on unchanged)
is put to the receiver first (``PUT /v1/images/{id}``), which answers the layers it
lacks; each is then streamed from the holder (``GET /v1/images/{id}/layers/{diff_id}``)
to the receiver (``PUT`` to the same path) with its signed entry in the headers below.
"""

from __future__ import annotations

from .models import Model

#: Headers of a layer's tar (its signed manifest entry), on the holder's answer and the
#: receiver's request.
DIGEST_HEADER = "X-Bunshin-Layer-Digest"
SIZE_HEADER = "X-Bunshin-Layer-Size"
MAC_HEADER = "X-Bunshin-Layer-Mac"
MEDIA_TYPE = "application/x-tar"


class ImageOut(Model):
    """A stored image; ``missing``: the diff ids of its layers this host does not hold."""

    id: str
    names: list[str]
    digests: list[str]
    layers: list[str]
    size_bytes: int
    created_at: float
    missing: list[str]

    @property
    def complete(self) -> bool:
        return not self.missing


class LayerOut(Model):
    """A layer put to a host: bytes it read, or ``skipped`` (it held the layer already)."""

    diff_id: str
    bytes_read: int
    skipped: bool
