"""A host's image store over HTTP (``client.images``): what it holds, its signed manifests,
and layers streamed in and out by digest (``bunshin.api.images``).

``copy_image(source.images, target.images, ref)`` moves an image from one host to another: the
target gets the manifest first and answers the layers it lacks; only those are
streamed, from the source's answer straight into the target's request (nothing is
spooled here). The target checks everything itself (``bunshin.runtime.oci.exchange``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from ..api.images import DIGEST_HEADER, MAC_HEADER, MEDIA_TYPE, SIZE_HEADER, ImageOut, LayerOut
from ..errors import ImageNotFound


class _Wire(Protocol):
    """What these calls need of :class:`~bunshin.client.Client`."""

    def request(self, method: str, path: str, *, json: Any = None) -> httpx.Response: ...

    def stream_bytes(self, method: str, path: str) -> Iterator[bytes]: ...

    def upload(self, method: str, path: str, chunks: Iterator[bytes], *,
               headers: dict[str, str] | None = None) -> httpx.Response: ...


class RemoteImages:
    """The image store of the host behind ``client`` (``Client.images``)."""

    def __init__(self, client: _Wire) -> None:
        self._client = client

    def list(self) -> list[ImageOut]:
        return [ImageOut.model_validate(d) for d in self._client.request("GET", "/v1/images").json()]

    def get(self, ref: str) -> ImageOut:
        """The stored image ``ref`` names (a name, an id or an id prefix); ``ImageNotFound``."""
        return ImageOut.model_validate(self._client.request("GET", f"/v1/images/{ref}").json())

    def holds(self, ref: str) -> bool:
        """Does the host hold ``ref`` with every one of its layers?"""
        try:
            return self.get(ref).complete
        except ImageNotFound:
            return False

    def manifest(self, ref: str) -> dict[str, Any]:
        """The image's manifest, signed with the host's snapshot key."""
        doc: dict[str, Any] = self._client.request("GET", f"/v1/images/{ref}/manifest").json()
        return doc

    def put_manifest(self, doc: dict[str, Any]) -> ImageOut:
        """Record the image of a signed manifest; its ``missing`` layers are the ones to send."""
        r = self._client.request("PUT", f"/v1/images/{doc.get('id')}", json=doc)
        return ImageOut.model_validate(r.json())

    def layer(self, image_id: str, diff_id: str) -> Iterator[bytes]:
        """The tar of one of the image's layers, as the host streams it."""
        return self._client.stream_bytes("GET", f"/v1/images/{image_id}/layers/{diff_id}")

    def put_layer(self, image_id: str, entry: dict[str, Any], chunks: Iterator[bytes]) -> LayerOut:
        """Stream a layer's tar to the host with its signed manifest ``entry``."""
        headers = {"Content-Type": MEDIA_TYPE, DIGEST_HEADER: entry["digest"], SIZE_HEADER: str(entry["size"]),
                   MAC_HEADER: entry["mac"]}  # chunked: a stream cut short arrives short, and is refused
        r = self._client.upload("PUT", f"/v1/images/{image_id}/layers/{entry['diff_id']}", chunks, headers=headers)
        return LayerOut.model_validate(r.json())


@dataclass
class ImageCopy:
    """What ``copy_image`` moved: layers sent and bytes, layers the target already held."""

    image: str
    layers_sent: list[str] = field(default_factory=list)
    layers_skipped: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def copy_image(source: RemoteImages, target: RemoteImages, ref: str) -> ImageCopy:
    """Give ``target`` (``client.images``) the image ``ref`` from ``source``, only the layers it lacks."""
    t0 = time.perf_counter()
    doc = source.manifest(ref)
    image_id = doc["id"]
    got = target.put_manifest(doc)
    out = ImageCopy(image_id)
    lacking = set(got.missing)
    for entry in doc["layers"]:
        if entry["diff_id"] not in lacking:
            out.layers_skipped.append(entry["diff_id"])
            continue
        done = target.put_layer(image_id, entry, source.layer(image_id, entry["diff_id"]))
        (out.layers_skipped if done.skipped else out.layers_sent).append(entry["diff_id"])
        out.bytes += done.bytes_read
    out.seconds = time.perf_counter() - t0
    return out
