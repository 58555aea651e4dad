"""Snapshots in a folder of their own: ``save`` one there, ``load`` it back later.

A saved snapshot holds everything a restore needs except its base image (the
host's root, or an image folder, recorded by path), the agent layer (named by its
version, rebuilt by the loading host) and the mask layer (rebuilt for the loading
config: it hides that config's own state)::

    DIR/snapshot.json     format, the record, the layer stack (top first), memory files,
                          the sha256 of every file below and an HMAC of it all
    DIR/images/*.img      the CRIU images
    DIR/layers/NAME.tar   each snapshot layer (xattrs, whiteouts and holes kept),
                          its memory-file links left out
    DIR/mem/NAME          a memory file's data extents back to back (the file
                          itself is sparse and terabytes long; the extents are
                          listed in snapshot.json)

A folder is untrusted input: it holds root code and CRIU images, and whoever
can write it chooses every name, path, limit and tar member in it. ``load``
therefore checks the manifest's HMAC-SHA256 (keyed by the home's
``snapshot_key_path``: only folders this home saved pass) and every file's
hash, unless the caller says ``trust``; with or without it, every id, name and
relative path is checked against a strict pattern, files are opened below the
folder without following symbolic links, tar members are inspected before GNU
tar sees them, the layer stack must have the shape ``take`` makes, the limits
are bounded by the host and sizes by free tmpfs and memory. Images, layer
archives and memory-file data are copied into this home's tmpfs once, hashed on
the way, and used only from there, so a folder changed during a load cannot
swap in other bytes.

``load`` copies all of it back under the config's tmpfs with the same layer and
memory-file names (the images name memory files by path), recomputes the host
paths and records the snapshot as kept. A snapshot layer already there (an
ancestor shared with another loaded snapshot) is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from ..config import Config
from ..errors import (
    ImageNotFound,
    InvalidArgument,
    ResourceExhausted,
    RuntimeFailure,
    SnapshotNotFound,
)
from . import agent_bundle, image_policy, images, memfile, statefs
from . import snapshot as rsnap
from .cgroups import parse_size
from .store import Store

FORMAT = "bunshin-snapshot/2"
_UNSIGNED_FORMATS = ("bunshin-snapshot/1",)  # older folders: no hashes, no MAC (load with trust)
MANIFEST = "snapshot.json"
_TAR_XATTRS = ["--xattrs", "--xattrs-include=*", "--numeric-owner"]
_CHUNK = 8 << 20
_ROLES = {"base", "mask", "agent", "snapshot"}
_MAC_PREFIX = "hmac-sha256:"
_TRUST_HINT = "load only folders this home saved, or pass --trust (Python: trust=True) for a folder you trust"

# What every id and name in a folder must look like (``take``, ``AgentBundle``, ``images``, ``memfile``)
SNAP_ID = re.compile(r"snap-[0-9a-f]{12}")
LAYER_NAMES = {"snapshot": SNAP_ID, "agent": re.compile(r"agent-[0-9a-f]{12}"),
               "mask": re.compile(r"mask-[0-9a-f]{12}")}
MEMFILE_NAME = re.compile(r"(snap-[0-9a-f]{12})-[0-9]{1,7}" + re.escape(memfile.SUFFIX))
_IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}\.img")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # workspace ids and host names
_SHA256 = re.compile(r"[0-9a-f]{64}")

# Memory files are sparse: their length is address room, not data (63 TiB measured for
# one agent process); bounded by the x86-64 user address space (128 TiB).
MAX_MEMFILE_SIZE = 1 << 47
MAX_MANIFEST_BYTES = 64 << 20
# ``container.create``'s own defaults, put back where a folder says "no limit"
DEFAULT_MEMORY = "2G"
DEFAULT_PIDS = 512
MIN_MEMORY = 1 << 20
MIN_PIDS = 8

_NUMBERS = ("created_at", "dump_ms", "pause_ms", "rewrite_ms", "memfile_bytes", "image_bytes", "layer_bytes")


# ------------------------------------------------------------------------- save


def save(cfg: Config, snap: rsnap.SnapshotRecord, dest: Path) -> Path:
    """Write ``snap`` into the folder ``dest`` (new or empty), signed for this home; returns it."""
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidArgument(f"{dest} exists and is not an empty folder", hint="save into a new folder")
    if not Path(snap.images).is_dir():
        raise SnapshotNotFound(f"the images of {snap.id} are gone", hint="was it removed meanwhile?")
    made = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        files: dict[str, str] = {}
        (dest / "images").mkdir()
        for f in sorted(Path(snap.images).glob("*.img")):  # CRIU wrote these: host-owned
            if f.is_file() and not f.is_symlink():
                files[f"images/{f.name}"] = _copy_file(f, dest / "images" / f.name)
        stack = (snap.layer, *snap.lowers)
        layers: list[dict[str, Any]] = []
        mems: list[dict[str, Any]] = []
        for i, path in enumerate(stack):
            layer = Path(path)
            entry: dict[str, Any] = {"name": layer.name, "role": _role(cfg, layer, base=i == len(stack) - 1),
                                     "path": path}
            if entry["role"] == "snapshot":  # agent and mask layers: rebuilt by whoever loads it
                entry["archive"] = f"layers/{layer.name}.tar"
                _tar(layer, dest / entry["archive"])
                files[entry["archive"]] = _sha256(dest / entry["archive"])
                for m in _save_memfiles(cfg, layer, dest / "mem"):
                    files[m["data"]] = m.pop("sha256")
                    mems.append({**m, "layer": layer.name})
            layers.append(entry)
        manifest: dict[str, Any] = {"format": FORMAT, "record": json.loads(snap.to_json()), "layers": layers,
                                    "memfiles": mems, "files": files}
        manifest["mac"] = mac(home_key(cfg, create=True), manifest)
        tmp = dest / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, dest / MANIFEST)
        return dest
    except BaseException:
        if made:
            shutil.rmtree(dest, ignore_errors=True)
        else:
            for p in dest.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise


def _role(cfg: Config, layer: Path, *, base: bool) -> str:
    if base:
        return "base"
    if layer.parent == cfg.tmpfs / "layers" and layer.name.startswith("mask-"):
        return "mask"
    return "agent" if layer.name.startswith("agent-") else "snapshot"


def _tar(layer: Path, archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    exclude = f"--exclude=./{rsnap.MEM_VIEW.lstrip('/')}/*{memfile.SUFFIX}"
    _run(["tar", "--create", "--file", str(archive), "--directory", str(layer), "--sparse",
          *_TAR_XATTRS, exclude, "."], f"cannot archive layer {layer}")


def _save_memfiles(cfg: Config, layer: Path, out_dir: Path) -> list[dict[str, Any]]:
    """The memory files this snapshot wrote, copied from the layer's memory-file view.

    The view is part of a layer the workspace wrote (its upper, frozen), so it may
    hold anything: only entries named for this snapshot that are regular files,
    reached without following a symbolic link and the very inode of the host's
    memory file, are taken (another name is the workspace's own file, left out of
    the archive like every memory-file name)."""
    vfd = _open_view(layer)
    if vfd is None:
        return []
    out: list[dict[str, Any]] = []
    try:
        for name in sorted(os.listdir(vfd)):
            m = MEMFILE_NAME.fullmatch(name)
            if not m or m.group(1) != layer.name:
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=vfd)
            except OSError as e:
                raise RuntimeFailure(f"memory file {name} of {layer.name} cannot be opened safely ({e.strerror})",
                                     hint="the workspace replaced it; the snapshot cannot be saved") from e
            try:
                st, host = os.fstat(fd), _lstat(rsnap.mem_dir(cfg) / name)
                if not stat.S_ISREG(st.st_mode) or host is None or (st.st_dev, st.st_ino) != (host.st_dev, host.st_ino):
                    raise RuntimeFailure(f"{name} in the layer of {layer.name} is not the memory file bunshin wrote",
                                         hint="the workspace replaced it; the snapshot cannot be saved")
                out.append(_save_memfile(fd, name, out_dir))
            finally:
                os.close(fd)
    finally:
        os.close(vfd)
    return out


def _open_view(layer: Path) -> int | None:
    """A descriptor of ``layer``'s memory-file view, each component below the (host-owned)
    layer folder opened without following symbolic links; None if there is none."""
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rsnap.MEM_VIEW.strip("/").split("/"):
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError:
        os.close(fd)
        return None
    return fd


def _save_memfile(fd: int, name: str, out_dir: Path) -> dict[str, Any]:
    """Copy a memory file's data extents into ``out_dir/name``; returns its manifest entry."""
    out_dir.mkdir(parents=True, exist_ok=True)
    extents: list[list[int]] = []
    h = hashlib.sha256()
    size = os.fstat(fd).st_size
    with open(out_dir / name, "wb") as f:
        pos = 0
        for off, n in memfile.data_extents(fd, 0, size):
            _copy_range(fd, off, f.fileno(), pos, n, h)
            extents.append([off, n])
            pos += n
    return {"name": name, "size": size, "extents": extents, "data": f"mem/{name}", "sha256": h.hexdigest()}


# --------------------------------------------------------------- authentication


def home_key(cfg: Config, *, create: bool) -> bytes | None:
    """This home's snapshot key (32 random bytes, mode 0600), made on first save."""
    path = cfg.snapshot_key_path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        key = os.urandom(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{key[:4].hex()}")
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(wfd, key)
            os.fsync(wfd)
            os.close(wfd)
            os.link(tmp, path)  # all or nothing: a concurrent first save keeps its own key
            return key
        except FileExistsError:
            return home_key(cfg, create=False)
        finally:
            tmp.unlink(missing_ok=True)
    try:
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise RuntimeFailure(f"{path} is not a snapshot key (32 bytes)",
                             hint="remove it: folders saved before then need --trust")
    return key


def mac(key: bytes | None, manifest: dict[str, Any]) -> str:
    """The MAC of a manifest: HMAC-SHA256 of its canonical JSON without the ``mac`` field."""
    assert key is not None
    body = {k: v for k, v in manifest.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return _MAC_PREFIX + hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _authenticate(cfg: Config, src: Path, manifest: dict[str, Any]) -> None:
    given = manifest.get("mac")
    key = home_key(cfg, create=False)
    if manifest.get("format") != FORMAT or not isinstance(given, str) or key is None:
        raise InvalidArgument(f"{src} is not signed by this home", hint=_TRUST_HINT)
    if not hmac.compare_digest(given, mac(key, manifest)):
        raise InvalidArgument(f"{src} was not saved by this home or was altered since", hint=_TRUST_HINT)


# ------------------------------------------------------------------- validation


def rel_parts(rel: Any, what: str) -> list[str]:
    """The components of a relative path inside a snapshot folder (no ``..``, nothing absolute)."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if (not parts or len(rel) > 1024 or "\0" in rel or rel.startswith("/")
            or any(p in ("", ".", "..") for p in parts)):
        raise InvalidArgument(f"{what}: {rel!r} is not a plain path inside the snapshot folder",
                              hint="a folder `snapshot save` wrote names only its own files")
    return parts


def check_record(data: Any, *, memory_total: int, pid_max: int) -> rsnap.SnapshotRecord:
    """The saved record, its fields checked; host-dependent ones are recomputed by ``load``."""
    try:
        rec = rsnap.SnapshotRecord.from_json(json.dumps(data))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise InvalidArgument(f"the saved record is damaged ({e})") from e
    bad = [f for f, ok in (
        ("id", isinstance(rec.id, str) and SNAP_ID.fullmatch(rec.id)),
        ("source", isinstance(rec.source, str) and _WORD.fullmatch(rec.source)),
        ("hostname", isinstance(rec.hostname, str) and _WORD.fullmatch(rec.hostname)),
        ("image", isinstance(rec.image, str) and 0 < len(rec.image) < 4096 and "\0" not in rec.image),
        ("mode", rec.mode in rsnap.MODES),
        ("depth", type(rec.depth) is int and 1 <= rec.depth <= 1 << 20),
        ("keep", isinstance(rec.keep, bool)),
        *((n, type(getattr(rec, n)) in (int, float) and getattr(rec, n) >= 0) for n in _NUMBERS),
    ) if not ok]
    if bad:
        raise InvalidArgument(f"the saved record has bad {', '.join(bad)}: {', '.join(repr(getattr(rec, f)) for f in bad)}",
                              hint="snapshot ids look like snap-<12 hex digits>")
    memory, pids = check_limits(rec.memory_limit, rec.pids_limit, memory_total=memory_total, pid_max=pid_max)
    return dataclasses.replace(rec, memory_limit=memory, pids_limit=pids)


def check_limits(memory: Any, pids: Any, *, memory_total: int, pid_max: int) -> tuple[int, int]:
    """Limits within what the host has; "none" becomes ``bunshin create``'s default."""
    memory = parse_size(DEFAULT_MEMORY) if memory is None else memory
    pids = DEFAULT_PIDS if pids is None else pids
    if type(memory) is not int or not MIN_MEMORY <= memory <= memory_total:
        raise InvalidArgument(f"the saved memory limit {memory!r} is not between {MIN_MEMORY} and the host's "
                              f"{memory_total} bytes", hint="a folder cannot ask for more than this host has")
    if type(pids) is not int or not MIN_PIDS <= pids <= pid_max:
        raise InvalidArgument(f"the saved pids limit {pids!r} is not between {MIN_PIDS} and {pid_max}",
                              hint="a folder cannot ask for more than this host has")
    return memory, pids


def check_layers(cfg: Config, entries: Any, rec: rsnap.SnapshotRecord) -> list[dict[str, Any]]:
    """The layer stack, top first: snapshot layers, the agent layer, the mask layer
    (exactly one, for the ``host`` image) and the base, as ``take`` makes it."""
    if not isinstance(entries, list) or not 3 <= len(entries) <= 4096 or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and e.get("role") in _ROLES for e in entries):
        raise InvalidArgument("the saved layer stack is damaged (bad entries or roles)")
    roles = [e["role"] for e in entries]
    tail = ["agent", "mask", "base"] if rec.image == images.HOST else ["agent", "base"]
    n = len(entries) - len(tail)
    if n < 1 or roles != ["snapshot"] * n + tail:
        raise InvalidArgument(f"the saved layer stack {roles} is not snapshot layers over "
                              f"{' over '.join(tail)}", hint="the mask and agent layers cannot be left out")
    names = [e["name"] for e in entries]
    if names[0] != rec.id or len(set(names[:n])) != n or not all(
            LAYER_NAMES[e["role"]].fullmatch(e["name"]) for e in entries[:-1]):
        raise InvalidArgument(f"the saved layer names {names[:-1]} are not this snapshot's and its ancestors' "
                              f"(snap-…, agent-…, mask-… with 12 hex digits)")
    for e in entries[:n]:
        rel_parts(e.get("archive"), f"layer {e['name']}")
    want = agent_bundle.current_layer_name()
    if names[n] != want:
        raise InvalidArgument(f"the snapshot runs agent layer {names[n]}, this bunshin builds {want}",
                              hint="it was saved by another bunshin version (or Python): load it with that one")
    _check_base(cfg, entries[-1].get("path"), rec.image)
    return entries


def _check_base(cfg: Config, path: Any, image: str) -> None:
    if image == images.HOST:
        if path != "/":
            raise InvalidArgument(f"the host image's base is {path!r}, not '/'")
        return
    if not isinstance(path, str) or not path.startswith("/") or os.path.normpath(path) != path or path == "/":
        raise InvalidArgument(f"the saved base image path {path!r} is not a plain absolute folder",
                              hint="an image folder is recorded by its absolute path")
    own = sorted({*images.hidden_paths(cfg), cfg.tmpfs} - set(images.FRESH))  # state, not fresh folders
    if any(Path(path).is_relative_to(h) or h.is_relative_to(path) for h in own):
        raise InvalidArgument(f"the saved base image {path} would show bunshin's own folders",
                              hint="an image folder must not contain or lie inside " + ", ".join(map(str, own)))


def check_memfiles(entries: Any, snapshot_layers: Iterable[str]) -> list[dict[str, Any]]:
    """Memory files: names for their layer, sizes bounded, extents sorted and inside the file."""
    layers = set(snapshot_layers)
    if not isinstance(entries, list) or len(entries) > 1 << 16:
        raise InvalidArgument("the saved memory-file list is damaged")
    seen: set[str] = set()
    for m in entries:
        name = m.get("name") if isinstance(m, dict) else None
        match = MEMFILE_NAME.fullmatch(name) if isinstance(name, str) else None
        if not match or name in seen or m.get("layer") != match.group(1) or m["layer"] not in layers:
            raise InvalidArgument(f"saved memory file {name!r} is not named <layer>-<pid>{memfile.SUFFIX} "
                                  f"for one of the snapshot layers {sorted(layers)}")
        seen.add(name)
        rel_parts(m.get("data"), f"memory file {name}")
        check_extents(m.get("extents"), m.get("size"), name)
    return entries


def check_extents(extents: Any, size: Any, name: str) -> int:
    """Sorted, non-overlapping ``[offset, length]`` pairs inside ``size``; returns their total."""
    if type(size) is not int or not 0 <= size <= MAX_MEMFILE_SIZE:
        raise InvalidArgument(f"memory file {name}: size {size!r} is not between 0 and {MAX_MEMFILE_SIZE}")
    if not isinstance(extents, list) or len(extents) > 1 << 24:
        raise InvalidArgument(f"memory file {name}: extents are not a list")
    end = total = 0
    for ext in extents:
        if not (isinstance(ext, list) and len(ext) == 2 and all(type(x) is int for x in ext)):
            raise InvalidArgument(f"memory file {name}: extent {ext!r} is not an [offset, length] pair of integers")
        off, n = ext
        if off < end or n <= 0 or off + n > size:
            raise InvalidArgument(f"memory file {name}: extent {ext!r} overlaps, is out of order or lies beyond "
                                  f"its size {size}")
        end, total = off + n, total + n
    return total


# Character devices a layer may hold: overlayfs whiteouts (0:0) and the nodes every
# workspace's /dev gets (``container.prepare_upper``: null, zero, full, random, urandom, tty)
SAFE_DEVICES = {(0, 0), (1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0)}
_FILE_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE}
_OK_TYPES = _FILE_TYPES | {tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE}


def check_tar_members(members: Iterable[tarfile.TarInfo], layer: str, ids: range | None = None) -> None:
    """Refuse a layer archive GNU tar could turn against the host, before it is unpacked.

    Refused: device nodes but whiteouts and /dev's own (``SAFE_DEVICES``), setuid/setgid bits on
    anything but a folder (setgid) and sticky bits on anything but a folder, absolute
    names or ``..``, names given twice, hard links to anything but an earlier regular
    file, a member below a symbolic link of the same archive (GNU tar would write
    through it), anything but folders on the memory-file view (``load`` links memory
    files there) and, given ``ids``, owners that are neither root nor in that range
    (the host ids workspaces map to).
    """
    kinds: dict[str, bytes] = {}
    symlinks: set[str] = set()
    view = rsnap.MEM_VIEW.strip("/") + "/"

    def refuse(ti: tarfile.TarInfo, why: str) -> InvalidArgument:
        return InvalidArgument(f"layer {layer}: archive member {ti.name!r} {why}",
                               hint="the archive was not written by `snapshot save`")

    for ti in members:
        name = _member_name(ti.name)
        if name is None:
            raise refuse(ti, "has an absolute name or a '..' component")
        if name in kinds:
            raise refuse(ti, "appears twice")
        if ti.type not in _OK_TYPES:
            raise refuse(ti, f"has type {ti.type!r}")
        if ti.type == tarfile.CHRTYPE and (ti.devmajor, ti.devminor) not in SAFE_DEVICES:
            raise refuse(ti, f"is a device node {ti.devmajor}:{ti.devminor}")
        special = ti.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX)
        if ti.isdir():
            special &= stat.S_ISUID
        if special:
            raise refuse(ti, f"has mode {ti.mode:o} (setuid, setgid or sticky)")
        if ids is not None and not all(i == 0 or i in ids for i in (ti.uid, ti.gid)):
            raise refuse(ti, f"is owned by {ti.uid}:{ti.gid}, neither root nor a workspace id")
        if ti.type == tarfile.LNKTYPE:
            target = _member_name(ti.linkname)
            if target is None or kinds.get(target) not in _FILE_TYPES:
                raise refuse(ti, f"is a hard link to {ti.linkname!r}, not to an earlier file of the archive")
        if (name.startswith(view) or view.startswith(name + "/")) and name and not ti.isdir():
            raise refuse(ti, "lies on the memory-file view, which holds only folders in an archive")
        if name == "" and not ti.isdir():
            raise refuse(ti, "replaces the layer's root folder")
        kinds[name] = ti.type
        if ti.issym():
            symlinks.add(name)
    for name in kinds:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise InvalidArgument(f"layer {layer}: archive member {name!r} lies below the symbolic link "
                                      f"{'/'.join(parts[:i])!r} of the same archive",
                                      hint="the archive was not written by `snapshot save`")


def _member_name(raw: str) -> str | None:
    """A member name relative to the layer ('' for the layer itself), None if it leaves it."""
    if raw.startswith("/") or "\0" in raw:
        return None
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    return None if ".." in parts else "/".join(parts)


# ------------------------------------------------------------------------- load


@dataclasses.dataclass
class _Folder:
    """A snapshot folder's checked manifest and its files, opened once below the folder."""

    src: Path
    record: rsnap.SnapshotRecord
    layers: list[dict[str, Any]]
    memfiles: list[dict[str, Any]]
    hashes: dict[str, str] | None  # None: trusted, not checked
    fds: dict[str, int]

    def size(self, rel: str) -> int:
        return os.fstat(self.fds[rel]).st_size


def load(cfg: Config, store: Store, src: Path, *, trust: bool = False) -> rsnap.SnapshotRecord:
    """Copy a saved snapshot back under ``cfg.tmpfs`` and record it (kept).

    Without ``trust`` only a folder this home saved, unchanged, loads; with it any
    folder does, but everything else is still checked (see the module docstring).
    """
    src = Path(src).absolute()
    try:
        dfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgument(f"{src} holds no saved snapshot ({e.strerror})",
                              hint="give a folder `snapshot save` wrote") from e
    fds: dict[str, int] = {}
    try:
        folder = _open_folder(cfg, src, dfd, trust, fds)
        return _load(cfg, store, folder)
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(dfd)


def _read_manifest(src: Path, dfd: int) -> dict[str, Any]:
    def no_constant(c: str) -> None:
        raise ValueError(f"{c} is not a number")

    try:
        fd = _open_below(dfd, MANIFEST, MANIFEST)
        try:
            if os.fstat(fd).st_size > MAX_MANIFEST_BYTES:
                raise InvalidArgument(f"{src / MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as f:
                manifest = json.loads(f.read(), parse_constant=no_constant)
        finally:
            os.close(fd)
    except (OSError, ValueError, InvalidArgument) as e:
        raise InvalidArgument(f"{src} holds no saved snapshot ({e})", hint="give a folder `snapshot save` wrote") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, *_UNSIGNED_FORMATS):
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise InvalidArgument(f"{src} is in format {found!r}, not {FORMAT!r}")
    return manifest


def _open_folder(cfg: Config, src: Path, dfd: int, trust: bool, fds: dict[str, int]) -> _Folder:
    """Check the manifest (MAC first unless ``trust``) and open every file it uses."""
    manifest = _read_manifest(src, dfd)
    if not trust:
        _authenticate(cfg, src, manifest)
    rec = check_record(manifest.get("record"), memory_total=psutil.virtual_memory().total, pid_max=_pid_max())
    if rec.mounts:  # host folders to share (--mount): named only by a folder the caller trusts
        if not trust:
            raise InvalidArgument(f"{src} shares host folders: {', '.join(map(str, rec.mounts))}", hint=_TRUST_HINT)
        rec = dataclasses.replace(rec, mounts=rsnap.container.check_shared(cfg, rec.mounts))
    layers = check_layers(cfg, manifest.get("layers"), rec)
    snaps = [e for e in layers if e["role"] == "snapshot"]
    mems = check_memfiles(manifest.get("memfiles"), (e["name"] for e in snaps))
    hashes = None if trust else _check_hashes(manifest.get("files"))
    wanted = [e["archive"] for e in snaps] + [m["data"] for m in mems] + _image_files(dfd)
    if len(set(wanted)) != len(wanted):
        raise InvalidArgument(f"{src / MANIFEST} names one file for two uses")
    if hashes is not None and set(hashes) != set(wanted):
        raise InvalidArgument(f"{src} holds other files than it was saved with: "
                              f"{sorted(set(hashes) ^ set(wanted))[:5]}", hint=_TRUST_HINT)
    for rel in wanted:
        fds[rel] = _open_below(dfd, rel, str(src / rel))
    folder = _Folder(src, rec, layers, mems, hashes, fds)
    for m in mems:
        if folder.size(m["data"]) != sum(n for _, n in m["extents"]):
            raise InvalidArgument(f"memory file {m['name']}: {m['data']} does not hold exactly its extents")
    return folder


def _check_hashes(files: Any) -> dict[str, str]:
    if not isinstance(files, dict) or not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in files.values()):
        raise InvalidArgument("the saved file hashes are damaged", hint=_TRUST_HINT)
    for rel in files:
        rel_parts(rel, "hashed file")
    return files


def _image_files(dfd: int) -> list[str]:
    try:
        ifd = os.open("images", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise InvalidArgument(f"the snapshot folder has no images folder ({e.strerror})") from e
    try:
        names = sorted(os.listdir(ifd))
    finally:
        os.close(ifd)
    bad = [n for n in names if not _IMAGE_NAME.fullmatch(n)]
    if bad or not names:
        raise InvalidArgument(f"the snapshot's images folder holds {bad[:3] or 'no images'}",
                              hint="only CRIU images (NAME.img) belong there")
    return [f"images/{n}" for n in names]


def _open_below(dfd: int, rel: str, shown: str) -> int:
    """Open the regular file ``rel`` below ``dfd`` for reading, never following a symbolic link."""
    parts = rel_parts(rel, shown)
    fd, opened = dfd, []
    try:
        for part in parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            opened.append(fd)
        out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                      dir_fd=fd)
    except OSError as e:
        raise InvalidArgument(f"{shown} cannot be opened inside the snapshot folder without following a "
                              f"symbolic link ({e.strerror})", hint="its files must be plain files") from e
    finally:
        for f in opened:
            os.close(f)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise InvalidArgument(f"{shown} is not a regular file", hint="its files must be plain files")
    return out


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22


def _load(cfg: Config, store: Store, folder: _Folder) -> rsnap.SnapshotRecord:
    saved = folder.record
    old = store.get_object(rsnap.KIND, saved.id)
    if old is not None:  # loaded before (or never removed): keep that one
        rec = dataclasses.replace(rsnap.SnapshotRecord.from_json(old), keep=True)
        store.put_object(rsnap.KIND, rec.id, rec.to_json())
        return rec
    base = folder.layers[-1]
    if base["role"] == "base" and not Path(base["path"]).is_dir():
        raise ImageNotFound(f"the base image {base['path']} of the saved snapshot is missing",
                            hint="put the image folder back at that path")
    statefs.ensure(cfg)
    layers_dir = cfg.tmpfs / "layers"
    todo = [e for e in folder.layers if e["role"] == "snapshot" and not (layers_dir / e["name"]).is_dir()]
    mems = {e["name"]: [m for m in folder.memfiles if m["layer"] == e["name"]] for e in todo}
    _check_space(cfg, folder, todo, [m for ms in mems.values() for m in ms])
    paths = [_host_layer(cfg, e) for e in folder.layers]
    own = [m for m in folder.memfiles if m["layer"] == saved.id]
    sdir = cfg.tmpfs / "snapshots" / saved.id
    rec = dataclasses.replace(
        saved, images=str(sdir / "images"), layer=paths[0], lowers=tuple(paths[1:]), keep=True,
        memfiles=tuple(str(rsnap.mem_dir(cfg) / m["name"]) for m in own), owner_pid=os.getpid(),
    )
    store.put_object(rsnap.KIND, rec.id, rec.to_json())  # recorded first, as ``take`` does
    try:
        (sdir / "images").mkdir(parents=True)
        for rel in sorted(r for r in folder.fds if r.startswith("images/")):
            _copy_in(folder, rel, sdir / rel, 0o644)  # read by criu inside the clone's user namespace
        image_policy.check(sdir / "images", cfg)  # trusted or not: criu restore runs as host root
        for entry in todo:
            _extract(cfg, folder, entry, mems[entry["name"]], sdir)
        rec = dataclasses.replace(rec, owner_pid=None)
        store.put_object(rsnap.KIND, rec.id, rec.to_json())
        return rec
    except BaseException:
        store.delete_object(rsnap.KIND, rec.id)
        shutil.rmtree(sdir, ignore_errors=True)
        rsnap.sweep(cfg, store)
        raise


def _check_space(cfg: Config, folder: _Folder, todo: list[dict[str, Any]], mems: list[dict[str, Any]]) -> None:
    """Refuse before copying when tmpfs or memory cannot hold what the folder brings."""
    tars = [folder.size(e["archive"]) for e in todo]
    need = sum(folder.size(r) for r in folder.fds if r.startswith("images/")) + sum(tars) + max(tars, default=0)
    need += sum(folder.size(m["data"]) for m in mems)
    st = os.statvfs(cfg.tmpfs)
    free, avail = st.f_bavail * st.f_frsize, psutil.virtual_memory().available
    if need > min(free, avail):
        raise ResourceExhausted(
            f"the saved snapshot needs {need >> 20} MiB; tmpfs {cfg.tmpfs} has {free >> 20} MiB free and the "
            f"host {avail >> 20} MiB of memory available",
            hint="remove snapshots or workspaces, or point BUNSHIN_TMPFS at a larger tmpfs",
        )


def _host_layer(cfg: Config, entry: dict[str, Any]) -> str:
    role = entry["role"]
    if role == "base":
        return str(entry["path"])
    if role == "mask":
        return str(images.mask_layer(cfg))
    if role == "agent":  # never from the folder: this host builds the version the images were made with
        return str(agent_bundle.AgentBundle.ensure(cfg.tmpfs / "layers").layer)
    return str(cfg.tmpfs / "layers" / entry["name"])


def _extract(cfg: Config, folder: _Folder, entry: dict[str, Any], mems: list[dict[str, Any]], sdir: Path) -> None:
    """Unpack one layer (and its memory files) under a temporary name, then rename it in place.

    The archive is copied (and hashed) into the snapshot's own folder first, and
    inspected and unpacked from that copy: the folder may change meanwhile."""
    layers_dir = cfg.tmpfs / "layers"
    layers_dir.mkdir(parents=True, exist_ok=True)
    staged = sdir / f"{entry['name']}.tar"
    tmp = layers_dir / f".load-{entry['name']}-{os.urandom(4).hex()}"
    try:
        _copy_in(folder, entry["archive"], staged)
        try:
            with tarfile.open(staged, "r:") as tf:
                check_tar_members(tf, entry["name"], _workspace_ids(cfg))
        except (tarfile.TarError, EOFError) as e:
            raise InvalidArgument(f"layer {entry['name']}: {entry['archive']} is not a tar archive ({e})") from e
        tmp.mkdir()
        _run(["tar", "--extract", "--file", str(staged), "--directory", str(tmp), "--no-overwrite-dir",
              "--same-permissions", "--same-owner", *_TAR_XATTRS], f"cannot unpack layer {entry['name']}")
        staged.unlink()
        if mems:
            vfd = _make_view(tmp)
            try:
                for m in mems:
                    host = rsnap.mem_dir(cfg) / m["name"]
                    if not host.exists():
                        _load_memfile(folder, m, host)
                    with memfile.unsealed(host):
                        os.link(host, m["name"], dst_dir_fd=vfd)
            finally:
                os.close(vfd)
        os.rename(tmp, layers_dir / entry["name"])
    except BaseException:
        staged.unlink(missing_ok=True)
        if tmp.exists():
            rsnap.remove_layer(tmp)
        for m in mems:  # removing the temporary links cleared the flag on the shared inode
            with contextlib.suppress(OSError):
                memfile.set_immutable(rsnap.mem_dir(cfg) / m["name"])
        raise


def _workspace_ids(cfg: Config) -> range | None:
    """The host ids workspaces map to (``Config.id_base``, ``id_count``); None before user namespaces."""
    base, count = getattr(cfg, "id_base", None), getattr(cfg, "id_count", None)
    return range(base, base + count) if isinstance(base, int) and isinstance(count, int) else None


def _make_view(layer: Path) -> int:
    """A descriptor of the memory-file view of an unpacked layer, made where missing and
    never reached through a symbolic link."""
    fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for part in rsnap.MEM_VIEW.strip("/").split("/"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as e:
        os.close(fd)
        raise InvalidArgument(f"the memory-file view of layer {layer.name} is not a folder ({e.strerror})") from e
    return fd


def _load_memfile(folder: _Folder, m: dict[str, Any], host: Path) -> None:
    host.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(host, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        h = hashlib.sha256()
        pos = 0
        for off, n in m["extents"]:
            _copy_range(folder.fds[m["data"]], pos, fd, off, n, h)
            pos += n
        _verify(folder, m["data"], h)
        os.ftruncate(fd, m["size"])
        os.fchmod(fd, 0o444)
    except BaseException:
        os.close(fd)
        host.unlink(missing_ok=True)
        raise
    os.close(fd)


def _copy_in(folder: _Folder, rel: str, dst: Path, mode: int = 0o600) -> None:
    """Copy one of the folder's files to ``dst`` (new), checking its hash on the way."""
    h = hashlib.sha256()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        _copy_range(folder.fds[rel], 0, fd, 0, folder.size(rel), h)
    finally:
        os.close(fd)
    _verify(folder, rel, h)


def _verify(folder: _Folder, rel: str, h: Any) -> None:
    if folder.hashes is not None and not hmac.compare_digest(h.hexdigest(), folder.hashes[rel]):
        raise InvalidArgument(f"{folder.src / rel} was altered after it was saved", hint=_TRUST_HINT)


def _copy_file(src: Path, dst: Path) -> str:
    """Copy a host file; returns its sha256."""
    h = hashlib.sha256()
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            _copy_range(fd, 0, out, 0, os.fstat(fd).st_size, h)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while buf := f.read(_CHUNK):
            h.update(buf)
    return h.hexdigest()


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int, h: Any = None) -> None:
    """Copy ``n`` bytes between file offsets, hashing them into ``h`` (plain reads and writes:
    memory-file offsets can lie beyond what the other filesystem allows, which ``sendfile`` refuses)."""
    while n > 0:
        buf = os.pread(src, min(n, _CHUNK), src_off)
        if not buf:
            raise InvalidArgument("unexpected end of file while copying a snapshot file")
        if h is not None:
            h.update(buf)
        view = memoryview(buf)
        while view:
            done = os.pwrite(dst, view, dst_off)
            view, src_off, dst_off, n = view[done:], src_off + done, dst_off + done, n - done


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeFailure(f"{what}: {proc.stderr.strip()[-2000:]}")
