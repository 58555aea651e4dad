"""Snapshots in a folder of their own: ``save`` one there, ``load`` it back later.

A saved snapshot holds everything a restore needs except its base image (the
host's root, or an image folder, recorded by path) and the mask layer (rebuilt
for the loading config: it hides that config's own state)::

    DIR/snapshot.json     format, the record, the layer stack (top first), memory files
    DIR/images/*.img      the CRIU images
    DIR/layers/NAME.tar   each other layer (xattrs, whiteouts and holes kept),
                          its memory-file links left out
    DIR/mem/NAME          a memory file's data extents back to back (the file
                          itself is sparse and terabytes long; the extents are
                          listed in snapshot.json)

``load`` copies all of it back under the config's tmpfs with the same layer and
memory-file names (the images name memory files by path), recomputes the host
paths and records the snapshot as kept. A layer already there (the agent layer,
or an ancestor shared with another loaded snapshot) is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import ImageNotFound, InvalidArgument, RuntimeFailure, SnapshotNotFound
from . import images, memfile, statefs
from . import snapshot as rsnap
from .store import Store

FORMAT = "bunshin-snapshot/1"
MANIFEST = "snapshot.json"
_TAR_XATTRS = ["--xattrs", "--xattrs-include=*", "--numeric-owner"]
_CHUNK = 8 << 20
_ROLES = {"base", "mask", "agent", "snapshot"}


# ------------------------------------------------------------------------- save


def save(cfg: Config, snap: rsnap.SnapshotRecord, dest: Path) -> Path:
    """Write ``snap`` into the folder ``dest`` (new or empty); returns it."""
    dest = Path(dest).absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise InvalidArgument(f"{dest} exists and is not an empty folder", hint="save into a new folder")
    if not Path(snap.images).is_dir():
        raise SnapshotNotFound(f"the images of {snap.id} are gone", hint="was it removed meanwhile?")
    made = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        (dest / "images").mkdir()
        for f in sorted(Path(snap.images).glob("*.img")):
            shutil.copyfile(f, dest / "images" / f.name)
        stack = (snap.layer, *snap.lowers)
        layers: list[dict[str, Any]] = []
        mems: list[dict[str, Any]] = []
        for i, path in enumerate(stack):
            layer = Path(path)
            entry: dict[str, Any] = {"name": layer.name, "role": _role(cfg, layer, base=i == len(stack) - 1),
                                     "path": path}
            if entry["role"] in ("snapshot", "agent"):
                entry["archive"] = f"layers/{layer.name}.tar"
                _tar(layer, dest / entry["archive"])
                for f in sorted((layer / rsnap.MEM_VIEW.lstrip("/")).glob(f"*{memfile.SUFFIX}")):
                    mems.append({**_save_memfile(f, dest / "mem" / f.name), "layer": layer.name})
            layers.append(entry)
        manifest = {"format": FORMAT, "record": json.loads(snap.to_json()), "layers": layers, "memfiles": mems}
        tmp = dest / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, dest / MANIFEST)
        return dest
    except BaseException:
        if made:
            shutil.rmtree(dest, ignore_errors=True)
        else:
            for p in dest.iterdir():
                if p.is_dir():
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


def _save_memfile(path: Path, out: Path) -> dict[str, Any]:
    """Copy a memory file's data extents into ``out``; returns its manifest entry."""
    out.parent.mkdir(parents=True, exist_ok=True)
    extents: list[list[int]] = []
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        with open(out, "wb") as f:
            pos = 0
            for off, n in memfile.data_extents(fd, 0, size):
                _copy_range(fd, off, f.fileno(), pos, n)
                extents.append([off, n])
                pos += n
    finally:
        os.close(fd)
    return {"name": path.name, "size": size, "extents": extents, "data": f"mem/{path.name}"}


def _copy_range(src: int, src_off: int, dst: int, dst_off: int, n: int) -> None:
    """Copy ``n`` bytes between file offsets (plain reads and writes: memory-file offsets
    can lie beyond what the other filesystem allows, which ``sendfile`` refuses)."""
    while n > 0:
        buf = os.pread(src, min(n, _CHUNK), src_off)
        if not buf:
            raise RuntimeFailure("unexpected end of file while copying a memory file")
        done = os.pwrite(dst, buf, dst_off)
        src_off, dst_off, n = src_off + done, dst_off + done, n - done


# ------------------------------------------------------------------------- load


def load(cfg: Config, store: Store, src: Path) -> rsnap.SnapshotRecord:
    """Copy a saved snapshot back under ``cfg.tmpfs`` and record it (kept)."""
    src = Path(src).absolute()
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{src} holds no saved snapshot ({e})", hint="give a folder `snapshot save` wrote") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise InvalidArgument(f"{src} is in format {found!r}, not {FORMAT!r}")
    statefs.ensure(cfg)
    try:
        saved = rsnap.SnapshotRecord.from_json(json.dumps(manifest["record"]))
        names = [str(e["name"]) for e in manifest["layers"] if e["role"] != "base"]
        names += [str(m["name"]) for m in manifest["memfiles"]]
        roles = {e["role"] for e in manifest["layers"]}
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidArgument(f"{src / MANIFEST} is damaged ({e!r})") from e
    if not manifest["layers"] or not roles <= _ROLES or any("/" in n or n in ("", ".", "..") for n in names):
        raise InvalidArgument(f"{src / MANIFEST} is damaged (bad layer roles or names)")
    old = store.get_object(rsnap.KIND, saved.id)
    if old is not None:  # loaded before (or never removed): keep that one
        rec = dataclasses.replace(rsnap.SnapshotRecord.from_json(old), keep=True)
        store.put_object(rsnap.KIND, rec.id, rec.to_json())
        return rec
    layers_dir = cfg.tmpfs / "layers"
    paths = [_host_layer(cfg, e) for e in manifest["layers"]]
    own = [m for m in manifest["memfiles"] if m["layer"] == manifest["layers"][0]["name"]]
    sdir = cfg.tmpfs / "snapshots" / saved.id
    rec = dataclasses.replace(
        saved, images=str(sdir / "images"), layer=paths[0], lowers=tuple(paths[1:]), keep=True,
        memfiles=tuple(str(rsnap.mem_dir(cfg) / m["name"]) for m in own), owner_pid=os.getpid(),
    )
    store.put_object(rsnap.KIND, rec.id, rec.to_json())  # recorded first, as ``take`` does
    try:
        (sdir / "images").mkdir(parents=True)
        for f in sorted((src / "images").glob("*.img")):
            shutil.copyfile(f, sdir / "images" / f.name)
        for entry in manifest["layers"]:
            if "archive" in entry and not (layers_dir / entry["name"]).is_dir():
                mems = [m for m in manifest["memfiles"] if m["layer"] == entry["name"]]
                _extract(cfg, src, entry, mems)
        rec = dataclasses.replace(rec, owner_pid=None)
        store.put_object(rsnap.KIND, rec.id, rec.to_json())
        return rec
    except BaseException:
        store.delete_object(rsnap.KIND, rec.id)
        shutil.rmtree(sdir, ignore_errors=True)
        rsnap.sweep(cfg, store)
        raise


def _host_layer(cfg: Config, entry: dict[str, Any]) -> str:
    role = entry["role"]
    if role == "base":
        if not Path(entry["path"]).is_dir():
            raise ImageNotFound(f"the base image {entry['path']} of the saved snapshot is missing",
                                hint="put the image folder back at that path")
        return str(entry["path"])
    if role == "mask":
        return str(images.mask_layer(cfg))
    return str(cfg.tmpfs / "layers" / entry["name"])


def _extract(cfg: Config, src: Path, entry: dict[str, Any], mems: list[dict[str, Any]]) -> None:
    """Unpack one layer (and its memory files) under a temporary name, then rename it in place."""
    layers_dir = cfg.tmpfs / "layers"
    layers_dir.mkdir(parents=True, exist_ok=True)
    tmp = layers_dir / f".load-{entry['name']}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _run(["tar", "--extract", "--file", str(src / entry["archive"]), "--directory", str(tmp),
              "--same-permissions", "--same-owner", *_TAR_XATTRS], f"cannot unpack layer {entry['name']}")
        view = tmp / rsnap.MEM_VIEW.lstrip("/")
        if mems:
            view.mkdir(parents=True, exist_ok=True)
        for m in mems:
            host = rsnap.mem_dir(cfg) / m["name"]
            if not host.exists():
                _load_memfile(src / m["data"], m, host)
            with memfile.unsealed(host):
                os.link(host, view / m["name"])
        os.rename(tmp, layers_dir / entry["name"])
    except BaseException:
        rsnap.remove_layer(tmp)
        for m in mems:  # removing the temporary links cleared the flag on the shared inode
            with contextlib.suppress(OSError):
                memfile.set_immutable(rsnap.mem_dir(cfg) / m["name"])
        raise


def _load_memfile(data: Path, m: dict[str, Any], host: Path) -> None:
    host.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(host, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with open(data, "rb") as f:
            pos = 0
            for off, n in m["extents"]:
                _copy_range(f.fileno(), pos, fd, off, n)
                pos += n
        os.ftruncate(fd, m["size"])
        os.fchmod(fd, 0o444)
    except BaseException:
        os.close(fd)
        host.unlink(missing_ok=True)
        raise
    os.close(fd)


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeFailure(f"{what}: {proc.stderr.strip()[-2000:]}")
