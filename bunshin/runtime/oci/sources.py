"""Images as files: OCI layout folders, OCI archives, ``docker save`` archives and
skopeo's ``dir:`` folders, read as (config, layer blobs) with every digest checked.

Everything here is untrusted input. A folder is read through descriptors without
following a symlink; an archive's members are looked up by their normalised names
(a ``docker save`` of old may link one ``layer.tar`` to another: followed inside the
archive only). Compressed archives (``.tar.gz``, ``.tar.zst``) are first
decompressed into the store's staging folder (their members need random access).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import posixpath
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from ...errors import ImageNotFound, InvalidArgument, ResourceExhausted
from ..kernel import syscalls as sc
from .caps import Budget
from .unpack import compression, decompressed

MAX_JSON = 8 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
REF_ANNOTATIONS = ("io.containerd.image.name", "org.opencontainers.image.ref.name")
_BROKEN = "the image archive is damaged or not an image"


class Source(Protocol):
    def open(self, rel: str) -> IO[bytes]: ...

    def exists(self, rel: str) -> bool: ...

    def close(self) -> None: ...


def _bad(where: str, why: str, hint: str = "give an OCI layout folder, an OCI archive or a `docker save` "
                                             "archive (.tar, .tar.gz, .tar.zst)") -> InvalidArgument:
    return InvalidArgument(f"{where}: {why}", hint=hint)


def read_json(src: Source, rel: str, where: str, digest: str | None = None) -> tuple[bytes, Any]:
    """The bytes of ``rel`` and their JSON, its sha256 checked against ``digest``."""
    try:
        with src.open(rel) as f:
            data = f.read(MAX_JSON + 1)
    except (FileNotFoundError, KeyError):
        raise _bad(where, f"{rel} is missing") from None
    except OSError as e:
        raise _bad(where, f"cannot read {rel}: {e}") from None
    if len(data) > MAX_JSON:
        raise _bad(where, f"{rel} is larger than {MAX_JSON >> 20} MiB")
    if digest is not None and "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise _bad(where, f"{rel}'s digest is not {digest}", "the image is corrupt or was edited: fetch it again")
    try:
        return data, json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise _bad(where, f"{rel} is not JSON ({e})") from None


class DirSource:
    """A folder, read without following symlinks."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def open(self, rel: str) -> IO[bytes]:
        parts = _norm(rel).split("/")
        try:
            dfd = sc.open_dir_beneath(self.root, parts[:-1])
        except OSError as e:
            raise FileNotFoundError(e.errno, f"{rel}: {e.strerror}") from None
        try:
            # O_NONBLOCK: a FIFO planted as a blob must not hang the open (it is refused below)
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
        if not os.path.isfile(f"/proc/self/fd/{fd}"):
            os.close(fd)
            raise FileNotFoundError(f"{rel} is not a regular file")
        return os.fdopen(fd, "rb")

    def exists(self, rel: str) -> bool:
        try:
            self.open(rel).close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        pass


class TarSource:
    """An uncompressed tar, its members by normalised name."""

    def __init__(self, path: Path) -> None:
        try:
            self.tar = tarfile.open(path, "r:")
            self.members = {_norm(m.name): m for m in self.tar.getmembers()}
        except (tarfile.TarError, EOFError, OSError) as e:
            raise _bad(str(path), f"not a readable tar archive ({e})",
                       "the archive is corrupt or truncated: make or download it again") from None

    def _member(self, rel: str) -> tarfile.TarInfo:
        name = _norm(rel)
        for _ in range(16):
            m = self.members.get(name)
            if m is None:
                raise FileNotFoundError(rel)
            if m.isreg():
                return m
            if not m.issym():
                raise FileNotFoundError(f"{rel} is not a file")
            name = _norm(posixpath.join(posixpath.dirname(name), m.linkname))
        raise FileNotFoundError(f"{rel}: too many links")

    def open(self, rel: str) -> IO[bytes]:
        f = self.tar.extractfile(self._member(rel))
        if f is None:
            raise FileNotFoundError(rel)
        return f

    def exists(self, rel: str) -> bool:
        try:
            self._member(rel)
        except OSError:
            return False
        return True

    def close(self) -> None:
        self.tar.close()


def _norm(rel: str) -> str:
    """A member name as a relative path inside the image; escaping ones are refused."""
    norm = posixpath.normpath("/" + rel.lstrip("/"))
    if rel.startswith("/") or ".." in rel.split("/"):
        raise FileNotFoundError(f"{rel!r} points outside the image")
    return norm.lstrip("/")


@contextlib.contextmanager
def open_source(path: Path, staging: Path, budget: Budget | None = None) -> Iterator[Source]:
    """``path`` (a folder or an archive, compressed or not) as a ``Source``; a compressed
    archive is decompressed into ``staging`` up to ``budget`` bytes (the image's size cap)."""
    if not os.path.lexists(path):
        raise ImageNotFound(f"no image file or folder at {path}", hint="give the path of an image archive or folder")
    if path.is_dir():
        yield DirSource(path)
        return
    tmp: Path | None = None
    try:
        with open(path, "rb") as f:
            if compression(f.read(4)) is None:
                source: Source = TarSource(path)
            else:
                f.seek(0)
                stream = decompressed(f)
                staging.mkdir(parents=True, exist_ok=True)
                tmp = staging / f".archive-{os.getpid()}-{os.urandom(4).hex()}.tar"
                try:
                    _decompress(stream, tmp, budget, f"the archive {path}")
                except OSError as e:
                    if e.errno == 28:
                        raise ResourceExhausted(f"no room to decompress {path} in {staging}",
                                                hint="free disk space or move BUNSHIN_HOME") from e
                    raise _bad(str(path), f"cannot decompress it ({e})",
                               "the archive is corrupt or truncated: make or download it again") from e
                except Exception as e:  # EOFError, BadGzipFile, zstd's errors
                    if isinstance(e, InvalidArgument):
                        raise
                    raise _bad(str(path), f"cannot decompress it ({type(e).__name__}: {e})",
                               "the archive is corrupt or truncated: make or download it again") from e
                source = TarSource(tmp)
        try:
            yield source
        finally:
            source.close()
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def _decompress(stream: IO[bytes], dest: Path, budget: Budget | None, what: str) -> None:
    """Write ``stream`` into the new file ``dest``, stopping before ``budget`` is passed."""
    done = 0
    with open(dest, "xb") as out:
        while chunk := stream.read(1 << 20):
            done += len(chunk)
            if budget is not None:
                budget.check(done, what)
            out.write(chunk)


# ------------------------------------------------------------------ image parts


@dataclass(frozen=True)
class LayerBlob:
    """One layer as the source holds it: where, its blob digest (None: an uncompressed
    ``docker save`` tar, checked by its diff id alone) and its diff id."""

    rel: str
    blob_digest: str | None
    diff_id: str


@dataclass(frozen=True)
class ImageParts:
    """One image of a source: its config (bytes, digest, document), layers, names."""

    config_bytes: bytes
    config: dict[str, Any]
    layers: tuple[LayerBlob, ...]
    names: tuple[str, ...]
    manifest_digest: str | None

    @property
    def id(self) -> str:
        return "sha256:" + hashlib.sha256(self.config_bytes).hexdigest()


def _digest(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith("sha256:") or not _HEX.match(value[7:]):
        raise _bad(where, f"digest {value!r} is not sha256:<64 hex digits>")
    return value


def _diff_ids(config: Any, where: str, count: int) -> list[str]:
    rootfs = config.get("rootfs") if isinstance(config, dict) else None
    ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(ids, list):
        raise _bad(where, "the image config has no rootfs.diff_ids")
    if len(ids) != count:
        raise _bad(where, f"the image config names {len(ids)} layers, the manifest {count}")
    return [_digest(d, where) for d in ids]


def images_in(src: Source, where: str) -> list[ImageParts]:
    """The images ``src`` holds (docker's manifest.json first, then an OCI index, then a
    skopeo ``dir:`` manifest)."""
    if src.exists("manifest.json"):
        _, doc = read_json(src, "manifest.json", where)
        if isinstance(doc, list):
            return [_docker_image(src, e, where) for e in doc]
        if isinstance(doc, dict) and "layers" in doc:
            return [_manifest_image(src, doc, where, _dir_blob, None, ())]
        raise _bad(where, "manifest.json is neither docker's nor a manifest")
    if src.exists("index.json"):
        _, index = read_json(src, "index.json", where)
        out = [img for d in _descriptors(index, where) for img in _from_descriptor(src, d, where, ())]
        if not out:
            raise _bad(where, "index.json names no image for this machine")
        return out
    raise _bad(where, f"{_BROKEN} (no manifest.json, no index.json)")


def _docker_image(src: Source, entry: Any, where: str) -> ImageParts:
    if not isinstance(entry, dict) or not isinstance(entry.get("Config"), str) \
            or not isinstance(entry.get("Layers"), list):
        raise _bad(where, "manifest.json's entry has no Config and Layers")
    cfg_rel = entry["Config"]
    hexpart = posixpath.basename(cfg_rel).removesuffix(".json")
    want = f"sha256:{hexpart}" if _HEX.match(hexpart) else None
    data, config = read_json(src, cfg_rel, where, want)
    layers_rel = entry["Layers"]
    diff_ids = _diff_ids(config, where, len(layers_rel))
    layers = []
    for rel, diff_id in zip(layers_rel, diff_ids, strict=True):
        if not isinstance(rel, str):
            raise _bad(where, f"layer {rel!r} is not a path")
        base = posixpath.basename(rel)
        blob = f"sha256:{base}" if _HEX.match(base) and posixpath.dirname(rel).endswith("sha256") else None
        layers.append(LayerBlob(rel, blob, diff_id))
    tags = entry.get("RepoTags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _bad(where, "manifest.json's RepoTags is not a list of names")
    return ImageParts(data, config, tuple(layers), tuple(tags), None)


def _oci_blob(digest: str) -> str:
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _dir_blob(digest: str) -> str:
    return digest.removeprefix("sha256:")


def _descriptors(index: Any, where: str) -> list[dict[str, Any]]:
    items = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(items, list) or not all(isinstance(d, dict) for d in items):
        raise _bad(where, "the index has no list of manifests")
    return items


def _machine_arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def _from_descriptor(src: Source, d: dict[str, Any], where: str, names: tuple[str, ...]) -> list[ImageParts]:
    digest = _digest(d.get("digest"), where)
    ann: dict[str, Any] = d["annotations"] if isinstance(d.get("annotations"), dict) else {}
    names = names + tuple(v for k in REF_ANNOTATIONS if isinstance(v := ann.get(k), str) and v)
    data, doc = read_json(src, _oci_blob(digest), where, digest)
    if d.get("mediaType") in INDEX_TYPES or (isinstance(doc, dict) and "manifests" in doc):
        picked = [m for m in _descriptors(doc, where)
                  if (m.get("platform") or {}).get("architecture", _machine_arch()) == _machine_arch()
                  and (m.get("platform") or {}).get("os", "linux") == "linux"]
        return [img for m in picked[:1] for img in _from_descriptor(src, m, where, names)]
    return [_manifest_image(src, doc, where, _oci_blob, digest, names)]


def _manifest_image(src: Source, manifest: Any, where: str, blob_path: Any, digest: str | None,
                    names: tuple[str, ...]) -> ImageParts:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict) \
            or not isinstance(manifest.get("layers"), list):
        raise _bad(where, "the manifest has no config and layers")
    cfg_digest = _digest(manifest["config"].get("digest"), where)
    data, config = read_json(src, blob_path(cfg_digest), where, cfg_digest)
    descs = manifest["layers"]
    if not all(isinstance(x, dict) for x in descs):
        raise _bad(where, "the manifest's layers are not descriptors")
    diff_ids = _diff_ids(config, where, len(descs))
    layers = tuple(LayerBlob(blob_path(_digest(x.get("digest"), where)), x["digest"], diff_id)
                   for x, diff_id in zip(descs, diff_ids, strict=True))
    return ImageParts(data, config, layers, names, digest)
