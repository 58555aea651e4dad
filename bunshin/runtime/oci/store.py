"""The image store: layers unpacked once by diff id, image records naming them.

Layers live under ``Config.paths.image_layers`` (disk, root only), one folder per
diff id, shared read-only by every image, workspace and snapshot stacking it. A
layer is unpacked into the staging folder and renamed into place only once it is
whole and its digests match: a crash, a refused member or a full disk leaves no
half layer under its name (``free`` removes stale staging). While a load runs, a
``pending`` record holds its layers against ``free``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from ...config import Config
from ...errors import ImageNotFound, InvalidArgument
from ..state.entries import remove_entry
from ..state.records import WorkspaceRecord
from ..state.store import Store
from . import caps
from .records import KIND, LAYER_KIND, LAYER_TAR_KIND, ImageConfig, ImageRecord
from .refs import Reference
from .sources import ImageParts, LayerBlob, Source, images_in, open_source
from .unpack import Unpacked, unpack

PENDING_KIND = "image-pending"
Progress = Callable[[str], None]
_STALE_S = 3600.0
_HEXID = re.compile(r"^(sha256:)?[0-9a-f]{4,64}$")


def quiet(_: str) -> None:
    pass


def normalize_name(name: str) -> str:
    """``repository:tag`` as docker normalises it."""
    return Reference.parse(name).normalized().name_tag()


def load(cfg: Config, store: Store, path: Path, *, tags: Iterable[str] = (), digest: str | None = None,
         progress: Progress = quiet, mapped_from: int | None = None) -> list[ImageRecord]:
    """Load every image of the archive or folder ``path``; ``tags`` name them too.
    ``mapped_from``: see ``unpack`` (only for what ``oci.build`` made)."""
    extra = tuple(normalize_name(t) for t in tags)
    with open_source(Path(path), cfg.paths.image_staging, caps.Budget.of(cfg)) as src:
        found = images_in(src, str(path))
        if extra and len(found) != 1:
            raise InvalidArgument(f"{path} holds {len(found)} images: a tag names one",
                                  hint="load it without --tag, then name them by id")
        return [add(cfg, store, src, parts, names=extra, digest=digest or parts.manifest_digest, progress=progress,
                    mapped_from=mapped_from) for parts in found]


def _names(parts: ImageParts) -> tuple[str, ...]:
    out = []
    for n in parts.names:
        if ":" in n or "/" in n:  # a bare tag (an OCI layout's ref.name) names nothing by itself
            try:
                out.append(normalize_name(n))
            except InvalidArgument:
                continue
    return tuple(out)


def add(cfg: Config, store: Store, src: Source, parts: ImageParts, *, names: tuple[str, ...] = (),
        digest: str | None = None, progress: Progress = quiet, mapped_from: int | None = None) -> ImageRecord:
    """Unpack the layers of ``parts`` the store lacks, then record the image. Refused
    (``PayloadTooLarge``) when it has more layers than ``cfg.image_max_layers``, before any
    is read, or unpacks to more than ``cfg.image_max_bytes`` (``caps``)."""
    config = ImageConfig.of(parts.config)
    caps.check_layers(cfg, len(parts.layers), f"image {parts.id[7:19]}")
    budget = caps.Budget.of(cfg)
    pending = f"{os.getpid()}-{os.urandom(4).hex()}"
    store.put_object(PENDING_KIND, pending, "\n".join(b.diff_id for b in parts.layers))
    try:
        total = 0
        for i, blob in enumerate(parts.layers, 1):
            size = _ensure_layer(cfg, store, src, blob, f"{i}/{len(parts.layers)}", progress, budget, mapped_from)
            total += size
        all_names = tuple(dict.fromkeys(_names(parts) + names))
        with store.transaction():
            _take_names(store, parts.id, all_names)
            old = get(store, parts.id)
            rec = ImageRecord(
                id=parts.id, layers=tuple(b.diff_id for b in parts.layers), config=config, size_bytes=total,
                created_at=old.created_at if old else time.time(),
                names=tuple(dict.fromkeys((*(old.names if old else ()), *all_names))),
                digests=tuple(dict.fromkeys((*(old.digests if old else ()), *((digest,) if digest else ())))),
                architecture=str(parts.config.get("architecture", "")), os=str(parts.config.get("os", "")),
                raw_config=parts.config,
            )
            store.put_object(KIND, rec.id, rec.to_json())
        progress(f"loaded {rec.short_id} {' '.join(rec.names)}".rstrip())
        return rec
    finally:
        store.delete_object(PENDING_KIND, pending)


def _take_names(store: Store, image_id: str, names: tuple[str, ...]) -> None:
    """A name moves to the image stored last: off every other image."""
    for other in list_images(store):
        if other.id != image_id and set(other.names) & set(names):
            kept = tuple(n for n in other.names if n not in names)
            store.put_object(KIND, other.id, _replace(other, names=kept).to_json())


def record(store: Store, rec: ImageRecord) -> ImageRecord:
    """Store ``rec`` (an image moved here: ``exchange``), its names taken over and merged
    with an earlier record of the same image."""
    with store.transaction():
        old = get(store, rec.id)
        _take_names(store, rec.id, rec.names)
        if old is not None:
            rec = _replace(rec, created_at=old.created_at, names=tuple(dict.fromkeys((*old.names, *rec.names))),
                           digests=tuple(dict.fromkeys((*old.digests, *rec.digests))))
        store.put_object(KIND, rec.id, rec.to_json())
    return rec


def complete(cfg: Config, store: Store, image_id: str) -> ImageRecord | None:
    """The stored image ``image_id`` if every one of its layers is in the store."""
    rec = get(store, image_id)
    if rec is None or not all(cfg.paths.image_layer(d).is_dir() and store.get_object(LAYER_KIND, d) is not None
                              for d in rec.layers):
        return None
    return rec


def name(store: Store, rec: ImageRecord, names: tuple[str, ...], digest: str | None) -> ImageRecord:
    """``rec`` also named ``names`` and known by ``digest``."""
    with store.transaction():
        _take_names(store, rec.id, names)
        cur = get(store, rec.id) or rec
        new = _replace(cur, names=tuple(dict.fromkeys((*cur.names, *names))),
                       digests=tuple(dict.fromkeys((*cur.digests, *((digest,) if digest else ())))))
        store.put_object(KIND, rec.id, new.to_json())
    return new


def _replace(rec: ImageRecord, **changes: object) -> ImageRecord:
    import dataclasses  # noqa: PLC0415

    return dataclasses.replace(rec, **changes)  # type: ignore[arg-type]


def _ensure_layer(cfg: Config, store: Store, src: Source, blob: LayerBlob, label: str, progress: Progress,
                  budget: caps.Budget, mapped_from: int | None = None) -> int:
    """The layer ``blob`` in the store (unpacked unless there, charged to ``budget``); its size in bytes."""
    rel, blob_digest, diff_id = blob.rel, blob.blob_digest, blob.diff_id
    known = stored_layer_size(cfg, store, diff_id)
    if known is not None:
        progress(f"layer {label} {diff_id[7:19]} already stored")
        return known

    def fill(tmp: Path) -> Unpacked:
        progress(f"layer {label} {diff_id[7:19]} unpacking")
        try:
            f = src.open(rel)
        except (OSError, KeyError) as e:
            raise InvalidArgument(f"layer {rel} of the image is missing ({e})",
                                  hint="the archive or folder is incomplete: make or download it again") from None
        with f:
            return unpack(f, str(tmp), id_base=cfg.id_base, id_count=cfg.id_count, blob_digest=blob_digest,
                          diff_id=diff_id, name=diff_id[7:19], mapped_from=mapped_from, budget=budget)

    return stage_layer(cfg, store, diff_id, fill).size_bytes


def stored_layer_size(cfg: Config, store: Store, diff_id: str) -> int | None:
    """The size of the layer ``diff_id`` if the store holds it whole (folder and record)."""
    known = store.get_object(LAYER_KIND, diff_id)
    if known is None or not cfg.paths.image_layer(diff_id).is_dir():
        return None
    return int(known.split()[0])


def stage_layer(cfg: Config, store: Store, diff_id: str, fill: Callable[[Path], Unpacked]) -> Unpacked:
    """Make the layer ``diff_id``: ``fill`` unpacks it into an empty staging folder (and
    checks it), which is then renamed into place and recorded; whatever ``fill`` raises,
    the staging folder is removed and nothing is stored under the layer's name."""
    final = cfg.paths.image_layer(diff_id)
    cfg.paths.image_layers.mkdir(parents=True, exist_ok=True)
    os.chmod(cfg.paths.images, 0o700)
    cfg.paths.image_staging.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".layer-{diff_id[7:19]}-", dir=cfg.paths.image_staging))
    try:
        os.chmod(tmp, 0o755)
        os.chown(tmp, cfg.id_base, cfg.id_base)
        done = fill(tmp)
        if stored_layer_size(cfg, store, diff_id) is not None:
            return done  # another load or move stored it meanwhile: in use maybe, kept as it is
        try:
            if final.is_dir():
                shutil.rmtree(final)  # a folder without its record: an interrupted rename, redone
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
        store.put_object(LAYER_KIND, diff_id, f"{done.size_bytes} {done.entries}")
        return done
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------ records


def get(store: Store, image_id: str) -> ImageRecord | None:
    data = store.get_object(KIND, image_id)
    return None if data is None else ImageRecord.from_json(data)


def list_images(store: Store) -> list[ImageRecord]:
    return sorted((ImageRecord.from_json(d) for _, d in store.list_objects(KIND)), key=lambda r: r.created_at)


def find(store: Store, ref: str) -> ImageRecord:
    """The image ``ref`` names: a name (``repo:tag``, normalised), ``name@sha256:...``, an id
    or a unique id prefix; ``ImageNotFound`` otherwise."""
    images = list_images(store)
    if isinstance(ref, str) and _HEXID.match(ref):
        hexpart = ref.removeprefix("sha256:")
        hits = [r for r in images if r.id[7:].startswith(hexpart)]
        if len(hits) == 1:
            return hits[0]
    try:
        parsed = Reference.parse(ref)
    except InvalidArgument:
        parsed = None
    if parsed is not None:
        norm = parsed.normalized()
        for r in images:
            if norm.digest and norm.digest in r.digests and (not r.names or any(
                    n.rsplit(":", 1)[0] == norm.repository for n in r.names) or norm.tag is None):
                return r
            if not norm.digest and norm.name_tag() in r.names:
                return r
    raise ImageNotFound(f"no stored image {ref!r}",
                        hint="`bunshin image ls` lists them; `bunshin image load FILE` or `bunshin image pull REF`")


def remove(store: Store, ref: str) -> ImageRecord:
    """Forget the image ``ref`` names (a name of several: that name only); its layers stay
    until ``free`` finds nothing holding them. Returns the record."""
    rec = find(store, ref)
    try:
        name = Reference.parse(ref).normalized().name_tag()
    except InvalidArgument:
        name = None
    if name in rec.names and len(rec.names) > 1:
        store.put_object(KIND, rec.id, _replace(rec, names=tuple(n for n in rec.names if n != name)).to_json())
    else:
        store.delete_object(KIND, rec.id)
    return rec


# ------------------------------------------------------------------ usage and gc


def layer_of(cfg: Config, path: str | Path) -> str | None:
    """The diff id of a store layer folder (None for any other path)."""
    p = Path(path)
    return f"sha256:{p.name}" if p.parent == cfg.paths.image_layers else None


def layers_in_use(cfg: Config, store: Store, workspaces: Iterable[WorkspaceRecord],
                  snapshot_lowers: Iterable[str]) -> set[str]:
    """Diff ids some image, workspace, snapshot or running load holds."""
    held = {d for r in list_images(store) for d in r.layers}
    for key, data in store.list_objects(PENDING_KIND):
        pid = int(key.split("-")[0])
        if psutil.pid_exists(pid):
            held.update(data.split())
        else:
            store.delete_object(PENDING_KIND, key)
    for path in [*(p for w in workspaces for p in w.lowers), *snapshot_lowers]:
        d = layer_of(cfg, path)
        if d is not None:
            held.add(d)
    return held


def free(cfg: Config, store: Store, snapshot_lowers: Iterable[str]) -> list[str]:
    """Remove the layers nothing holds (no image, workspace, snapshot, running load) and
    staging left by a crash; what was removed. ``snapshot_lowers``: every snapshot's
    layers (``gc.free_image_layers`` gives them)."""
    held = layers_in_use(cfg, store, store.list_workspaces(), snapshot_lowers)
    out = []
    if cfg.paths.image_layers.is_dir():
        for d in cfg.paths.image_layers.iterdir():
            if f"sha256:{d.name}" not in held:
                shutil.rmtree(d, ignore_errors=True)
                store.delete_object(LAYER_KIND, f"sha256:{d.name}")
                store.delete_object(LAYER_TAR_KIND, f"sha256:{d.name}")
                out.append(str(d))
    if cfg.paths.image_staging.is_dir():
        loading = bool(store.list_objects(PENDING_KIND))
        for d in cfg.paths.image_staging.iterdir():
            if not loading or time.time() - d.lstat().st_mtime > _STALE_S:
                remove_entry(d)
                out.append(str(d))
    return out


def stored_layers(cfg: Config) -> list[str]:
    """Diff ids of the layer folders on disk."""
    d = cfg.paths.image_layers
    return sorted(f"sha256:{p.name}" for p in d.iterdir()) if d.is_dir() else []


def lowers(cfg: Config, rec: ImageRecord) -> list[Path]:
    """The image's layer folders, top first (overlayfs's order); ``ImageNotFound`` if one is gone."""
    out = [cfg.paths.image_layer(d) for d in reversed(rec.layers)]
    missing = [p for p in out if not p.is_dir()]
    if missing:
        raise ImageNotFound(f"image {rec.short_id} lacks {len(missing)} of its layers in the store",
                            hint="load or pull the image again")
    return out
