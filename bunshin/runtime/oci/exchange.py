"""Images moved between hosts by digest: the image's record first, then only the layers
the receiver lacks.

``manifest`` is what the holder sends: the image's id, names, config and, per layer,
its diff id and the sha256 and size of its exported tar (``layer_tar``), signed with
the home's snapshot key (HMAC-SHA256, as ``folder_save`` signs a saved snapshot; the
hosts of a cluster share that key, ``bunshin.cluster.serve_proc``). A receiver trusts
nothing it does not check:

- ``import_image`` takes a manifest only with a MAC its own key makes, whose layers
  are the diff ids its config lists, in order, and whose config passes the store's
  checks; it records the image (its layers held against ``free`` from then on) and
  says which layers it lacks.
- ``import_layer`` takes a layer's tar only for a layer of an image recorded so, with
  that entry's digest and size, also signed (``layer_mac``: an entry on its own, so one
  request needs no state). The stream is unpacked by ``unpack`` (no name out of the
  layer, no device, nothing through a symlink, ids in the workspaces' range) into a
  staging folder while it is hashed and counted; more bytes than signed, fewer, or
  other bytes and the folder is removed and nothing is stored.
"""

from __future__ import annotations

import hmac
import re
import time
from dataclasses import dataclass
from typing import IO, Any

from ...config import Config
from ...errors import ImageNotFound, InvalidArgument, Unauthorized
from ..state.keys import home_key, mac
from ..state.store import Store
from . import caps, layer_tar
from . import store as oci_store
from .records import ImageConfig, ImageRecord
from .unpack import unpack

FORMAT = "bunshin-image-1"
LAYER_FORMAT = "bunshin-image-layer-1"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_KEY_HINT = ("hosts of one cluster share a snapshot key (BUNSHIN_HOME/snapshot.key): `bunshin cluster up` puts "
             "the one derived from the cluster secret into every host's home")


@dataclass(frozen=True)
class LayerEntry:
    """A layer as a manifest lists it: its diff id, its exported tar's digest and size,
    and the MAC of those three."""

    diff_id: str
    digest: str
    size: int
    mac: str

    def to_dict(self) -> dict[str, Any]:
        return {"diff_id": self.diff_id, "digest": self.digest, "size": self.size, "mac": self.mac}


@dataclass(frozen=True)
class LayerImport:
    """What ``import_layer`` did: ``skipped`` when the layer was already stored (nothing read)."""

    diff_id: str
    bytes_read: int
    skipped: bool


def _key(cfg: Config, *, create: bool) -> bytes:
    key = home_key(cfg, create=create)
    if key is None:
        raise Unauthorized("this home has no snapshot key to check a moved image with", hint=_KEY_HINT)
    return key


def layer_mac(key: bytes, diff_id: str, digest: str, size: int) -> str:
    return mac(key, {"format": LAYER_FORMAT, "diff_id": diff_id, "digest": digest, "size": size})


def manifest(cfg: Config, store: Store, ref: str) -> dict[str, Any]:
    """The signed manifest of the stored image ``ref`` (every layer's tar described
    first: a pass over a layer the first time only)."""
    rec = oci_store.complete(cfg, store, oci_store.find(store, ref).id)
    if rec is None:
        raise ImageNotFound(f"image {ref!r} lacks some of its layers here", hint="load or pull it again")
    key = _key(cfg, create=True)
    layers = []
    for d in rec.layers:
        t = layer_tar.describe(cfg, store, d)
        layers.append(LayerEntry(d, t.digest, t.size, layer_mac(key, d, t.digest, t.size)).to_dict())
    doc: dict[str, Any] = {"format": FORMAT, "id": rec.id, "names": list(rec.names), "digests": list(rec.digests),
                           "config": rec.raw_config, "size_bytes": rec.size_bytes, "layers": layers}
    doc["mac"] = mac(key, doc)
    return doc


def _bad(why: str) -> InvalidArgument:
    return InvalidArgument(f"image manifest refused: {why}", hint="send the manifest the holder's "
                           "GET /v1/images/{id}?manifest=true answered, unchanged")


def check_manifest(cfg: Config, doc: Any) -> tuple[ImageRecord, list[LayerEntry]]:
    """The record and layer entries of a manifest this home's key signed; refused otherwise."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(f"its format is not {FORMAT!r}")
    given = doc.get("mac")
    if not isinstance(given, str) or not hmac.compare_digest(given, mac(_key(cfg, create=False), doc)):
        raise Unauthorized("image manifest refused: it is not signed with this host's snapshot key "
                           "(or was altered)", hint=_KEY_HINT)
    image_id, config, layers = doc.get("id"), doc.get("config"), doc.get("layers")
    if not isinstance(image_id, str) or not _DIGEST.fullmatch(image_id):
        raise _bad(f"id {image_id!r} is not a sha256 digest")
    if not isinstance(config, dict) or not isinstance(layers, list) or not layers:
        raise _bad("it needs a config and at least one layer")
    caps.check_layers(cfg, len(layers), f"image {image_id[7:19]}")
    entries = [check_entry(e) for e in layers]
    caps.Budget.of(cfg).check(sum(e.size for e in entries), f"image {image_id[7:19]}")
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if diff_ids != [e.diff_id for e in entries]:
        raise _bad("its layers are not the diff ids its config lists")
    names = [oci_store.normalize_name(n) for n in _strings(doc.get("names"), "names")]
    digests = [d for d in _strings(doc.get("digests"), "digests") if _DIGEST.fullmatch(d)]
    size = doc.get("size_bytes")
    rec = ImageRecord(id=image_id, layers=tuple(e.diff_id for e in entries), config=ImageConfig.of(config),
                      size_bytes=size if isinstance(size, int) and size >= 0 else 0, created_at=time.time(),
                      names=tuple(names), digests=tuple(digests), architecture=str(config.get("architecture", "")),
                      os=str(config.get("os", "")), raw_config=config)
    return rec, entries


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _bad(f"its {what} is not a list of strings")
    return value


def check_entry(e: Any) -> LayerEntry:
    """A layer entry of the right shape (its MAC is checked where it is used)."""
    if not isinstance(e, dict):
        raise _bad("a layer entry is not an object")
    diff_id, digest, size, m = e.get("diff_id"), e.get("digest"), e.get("size"), e.get("mac")
    if not (isinstance(diff_id, str) and _DIGEST.fullmatch(diff_id) and isinstance(digest, str)
            and _DIGEST.fullmatch(digest) and isinstance(size, int) and not isinstance(size, bool)
            and size > 0 and isinstance(m, str)):
        raise _bad(f"layer entry {str(e)[:200]} is malformed")
    return LayerEntry(diff_id, digest, size, m)


def missing(cfg: Config, store: Store, rec: ImageRecord) -> list[str]:
    """The layers of ``rec`` this store does not hold whole, in the image's order."""
    return [d for d in rec.layers if oci_store.stored_layer_size(cfg, store, d) is None]


def import_image(cfg: Config, store: Store, doc: Any) -> tuple[ImageRecord, list[str]]:
    """Record the image of the signed manifest ``doc`` (names taken over, as a load
    does); the record and the layers still to send, in order."""
    rec = oci_store.record(store, check_manifest(cfg, doc)[0])
    return rec, missing(cfg, store, rec)


def import_layer(cfg: Config, store: Store, image_id: str, entry: LayerEntry, stream: IO[bytes]) -> LayerImport:
    """Unpack the layer tar ``stream`` as ``entry`` says, for the recorded image ``image_id``."""
    if not hmac.compare_digest(entry.mac, layer_mac(_key(cfg, create=False), entry.diff_id, entry.digest,
                                                    entry.size)):
        raise Unauthorized(f"layer {entry.diff_id} refused: its entry is not signed with this host's snapshot key "
                           "(or was altered)", hint=_KEY_HINT)
    rec = oci_store.get(store, image_id)
    if rec is None or entry.diff_id not in rec.layers:
        raise ImageNotFound(f"no image {image_id} with layer {entry.diff_id} is recorded here",
                            hint="send the image's manifest first (PUT /v1/images/{id})")
    if oci_store.stored_layer_size(cfg, store, entry.diff_id) is not None:
        return LayerImport(entry.diff_id, 0, skipped=True)
    read = 0
    budget = caps.Budget.of(cfg)  # one layer at a time: each within the image's cap

    def fill(tmp: Any) -> Any:
        nonlocal read
        done = unpack(stream, str(tmp), id_base=cfg.id_base, id_count=cfg.id_count, blob_digest=None,
                      diff_id=entry.digest, name=entry.diff_id[7:19], limit=entry.size,
                      told_by="its signed entry", budget=budget)
        if done.blob_digest != entry.digest:  # uncompressed: the tar is the stream itself
            raise InvalidArgument(f"layer {entry.diff_id[7:19]}: the stream is not the tar its entry names",
                                  hint="fetch the layer again from its holder")
        read = entry.size
        return done

    oci_store.stage_layer(cfg, store, entry.diff_id, fill)
    return LayerImport(entry.diff_id, read, skipped=False)
