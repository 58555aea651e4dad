"""The checks a saved snapshot folder passes before ``folder_load.load`` uses any of it.

A folder is untrusted input (root code and CRIU images): its manifest is
authenticated with a key of the home (HMAC-SHA256 over the manifest, which lists
every file's sha256), and every id, name, relative path, limit, layer stack,
memory-file extent and tar member is checked here. The CRIU images themselves are
checked by ``image_policy``.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import re
import stat
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import InvalidArgument
from .. import memfile
from ..agent_host import bundle as agent_bundle
from ..container import images
from ..container.cgroups import parse_size
from ..state.keys import home_key as home_key  # re-exported: folder_save, folder_load, cluster
from ..state.keys import mac as mac
from ..state.records import SnapshotMode
from . import lifetime as rsnap_lifetime
from . import precopy

FORMAT = "bunshin-snapshot/2"
_UNSIGNED_FORMATS = ("bunshin-snapshot/1",)  # older folders: no hashes, no MAC (load with trust)
_ROLES = {"base", "mask", "agent", "snapshot", "image"}
_TRUST_HINT = "load only folders this home saved, or pass --trust (Python: trust=True) for a folder you trust"
_FOLDER_HINT = ("if that folder is a root filesystem you mean workspaces to see, create one on it first "
                "(`bunshin create --image DIR`), then load; or load a folder this home saved")

# What every id and name in a folder must look like (``take``, ``AgentBundle``, ``images``, ``memfile``)
SNAP_ID = re.compile(r"snap-[0-9a-f]{12}")
LAYER_NAMES = {"snapshot": SNAP_ID, "agent": re.compile(r"agent-[0-9a-f]{12}"),
               "mask": re.compile(r"mask-[0-9a-f]{12}"),
               "image": re.compile(r"[0-9a-f]{64}")}  # a layer of the image store, by diff id
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


# --------------------------------------------------------------- authentication


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


def check_record(data: Any, *, memory_total: int, pid_max: int) -> rsnap_lifetime.SnapshotRecord:
    """The saved record, its fields checked; host-dependent ones are recomputed by ``load``."""
    # an unknown mode is reported below with the other bad fields, not as damage
    unknown_mode = isinstance(data, dict) and "mode" in data and data["mode"] not in rsnap_lifetime.MODES
    shown = {"mode": data["mode"]} if unknown_mode else {}
    try:
        rec = rsnap_lifetime.SnapshotRecord.from_json(json.dumps({**data, "mode": SnapshotMode.COW} if unknown_mode else data))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise InvalidArgument(f"the saved record is damaged ({e})") from e
    bad = [f for f, ok in (
        ("id", isinstance(rec.id, str) and SNAP_ID.fullmatch(rec.id)),
        ("source", isinstance(rec.source, str) and _WORD.fullmatch(rec.source)),
        ("hostname", isinstance(rec.hostname, str) and _WORD.fullmatch(rec.hostname)),
        ("image", isinstance(rec.image, str) and 0 < len(rec.image) < 4096 and "\0" not in rec.image),
        ("mode", not unknown_mode),
        ("depth", type(rec.depth) is int and 1 <= rec.depth <= 1 << 20),
        ("keep", isinstance(rec.keep, bool)),
        *((n, type(getattr(rec, n)) in (int, float) and getattr(rec, n) >= 0) for n in _NUMBERS),
    ) if not ok]
    if bad:
        raise InvalidArgument(f"the saved record has bad {', '.join(bad)}: {', '.join(repr(shown.get(f, getattr(rec, f))) for f in bad)}",
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


def check_layers(cfg: Config, entries: Any, rec: rsnap_lifetime.SnapshotRecord,
                 known_bases: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """The layer stack, top first: snapshot layers, the agent layer, the mask layer
    (exactly one, for the ``host`` image) and the base, as ``take`` makes it.
    ``known_bases``: the folder images a folder this home did not sign may name (None:
    it did sign it; any folder that passes ``_check_base`` then)."""
    if not isinstance(entries, list) or not 3 <= len(entries) <= 4096 or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and e.get("role") in _ROLES for e in entries):
        raise InvalidArgument("the saved layer stack is damaged (bad entries or roles)")
    roles = [e["role"] for e in entries]
    stored = roles.count("image")  # an image workspace: the image's layers, by diff id, are its base
    tail = ["agent", "mask", "base"] if rec.image == images.HOST else \
        ["agent", *["image"] * stored] if stored else ["agent", "base"]
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
    if not stored:
        _check_base(cfg, entries[-1].get("path"), rec.image)
        if rec.image != images.HOST and known_bases is not None and entries[-1]["path"] not in known_bases:
            raise InvalidArgument(
                f"the saved base image {entries[-1]['path']} is a host folder this home does not know as an image: "
                "a folder it did not sign may stack only on 'host', stored images or a folder image one of "
                "its workspaces or snapshots uses", hint=_FOLDER_HINT)
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
        live = None if match or not isinstance(name, str) else precopy.LIVE_NAME.fullmatch(name)
        if (not (match or live) or name in seen or m.get("layer") not in layers
                or (match and m["layer"] != match.group(1))):
            raise InvalidArgument(f"saved memory file {name!r} is not named <layer>-<pid>{memfile.SUFFIX} "
                                  f"for one of the snapshot layers {sorted(layers)} (nor a live pre-copy's "
                                  f"live-<workspace>-<tag>{memfile.SUFFIX} of one of them)")
        name = (match or live).group(0)  # type: ignore[union-attr]  # the name, checked
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
# The extended attributes a loaded layer keeps (GNU tar's --xattrs-include, on save and
# load, whatever the trust): the workspace's own user.* ones and overlayfs's opaque
# folder, which only hides what lies below (as the workspace's ``rm -rf``; "y", on a
# folder: ``OPAQUE_XATTR``). Every other trusted.* and security.* one is dropped: overlayfs
# follows a lower layer's trusted.overlay.redirect and metacopy to other paths of the
# stack (past the mask layer onto host files), and a v2 security.capability gives host
# processes capabilities.
OPAQUE_XATTR = "trusted.overlay.opaque"
KEPT_XATTRS = ("user.*", OPAQUE_XATTR)
_PAX_XATTR = "SCHILY.xattr."
_FILE_TYPES = {tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE}
_OK_TYPES = _FILE_TYPES | {tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE}


def check_tar_members(members: Iterable[tarfile.TarInfo], layer: str, ids: range | None = None) -> None:
    """Refuse a layer archive GNU tar could turn against the host, before it is unpacked.

    Refused: device nodes but whiteouts and /dev's own (``SAFE_DEVICES``), setuid/setgid bits on
    anything but a folder (setgid) and sticky bits on anything but a folder, absolute
    names or ``..``, names given twice, hard links to anything but an earlier regular
    file, a member below a symbolic link of the same archive (GNU tar would write
    through it), anything but folders on the memory-file view (``load`` links memory
    files there), an opaque mark overlayfs would not write, an xattr in libarchive's form
    and, given ``ids``, owners that are neither root nor in that range (the host ids
    workspaces map to). Other xattrs than ``KEPT_XATTRS`` are dropped by the unpack.
    """
    kinds: dict[str, bytes] = {}
    symlinks: set[str] = set()
    view = rsnap_lifetime.MEM_VIEW.strip("/") + "/"

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
        _check_xattrs(ti, refuse)
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


def _check_xattrs(ti: tarfile.TarInfo, refuse: Any) -> None:
    """An opaque mark only as overlayfs writes it; no xattr in libarchive's form (not
    written by ``save``: GNU tar's filter may not see it). Others are dropped on unpack."""
    for key, value in ti.pax_headers.items():
        if key.startswith("LIBARCHIVE.xattr."):
            raise refuse(ti, f"carries an extended attribute in libarchive's form ({key[:80]!r})")
        if key == _PAX_XATTR + OPAQUE_XATTR and (value != "y" or not ti.isdir()):
            raise refuse(ti, f"carries {OPAQUE_XATTR}={value[:20]!r} (overlayfs writes 'y', on folders only)")


def _member_name(raw: str) -> str | None:
    """A member name relative to the layer ('' for the layer itself), None if it leaves it."""
    if raw.startswith("/") or "\0" in raw:
        return None
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    return None if ".." in parts else "/".join(parts)
