"""Saving a snapshot into a folder of its own (the format: ``folder``), signed for this home."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import (
    InvalidArgument,
    RuntimeFailure,
    SnapshotNotFound,
)
from .. import memfile
from ..state.entries import remove_entry
from . import lifetime as rsnap_lifetime
from . import precopy
from .checks import (
    FORMAT,
    MEMFILE_NAME,
    home_key,
    mac,
)
from .folder import _TAR_XATTRS, MANIFEST, _copy_file, _copy_range, _lstat, _run, _sha256


def save(cfg: Config, snap: rsnap_lifetime.SnapshotRecord, dest: Path) -> Path:
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
        live: set[str] = set()  # live pre-copy files: saved once, with the top-most layer linking them
        for i, path in enumerate(stack):
            layer = Path(path)
            entry: dict[str, Any] = {"name": layer.name, "role": _role(cfg, layer, base=i == len(stack) - 1)}
            if entry["role"] != "image":
                entry["path"] = path
            if entry["role"] == "snapshot":  # agent and mask layers: rebuilt by whoever loads it
                entry["archive"] = f"layers/{layer.name}.tar"
                _tar(layer, dest / entry["archive"])
                files[entry["archive"]] = _sha256(dest / entry["archive"])
                for m in _save_memfiles(cfg, layer, dest / "mem", live):
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
                remove_entry(p)
        raise


def _role(cfg: Config, layer: Path, *, base: bool) -> str:
    if layer.parent == cfg.paths.image_layers:
        return "image"  # named by its diff id, never copied: the loading home must hold it
    if base:
        return "base"
    if layer.parent == cfg.paths.layers and layer.name.startswith("mask-"):
        return "mask"
    return "agent" if layer.name.startswith("agent-") else "snapshot"


def _tar(layer: Path, archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    exclude = f"--exclude=./{rsnap_lifetime.MEM_VIEW.lstrip('/')}/*{memfile.SUFFIX}"
    _run(["tar", "--create", "--file", str(archive), "--directory", str(layer), "--sparse",
          *_TAR_XATTRS, exclude, "."], f"cannot archive layer {layer}")


def _save_memfiles(cfg: Config, layer: Path, out_dir: Path, live: set[str]) -> list[dict[str, Any]]:
    """The memory files this snapshot wrote, copied from the layer's memory-file view.

    The view is part of a layer the workspace wrote (its upper, frozen), so it may
    hold anything: only entries named for this snapshot, or a live pre-copy's file
    (``precopy.LIVE_NAME``, each once: ``live`` holds those saved already), that are
    regular files, reached without following a symbolic link and the very inode of
    the host's memory file, are taken (another name is the workspace's own file,
    left out of the archive like every memory-file name)."""
    vfd = _open_view(layer)
    if vfd is None:
        return []
    out: list[dict[str, Any]] = []
    try:
        for name in sorted(os.listdir(vfd)):
            m = MEMFILE_NAME.fullmatch(name)
            if (not m or m.group(1) != layer.name) and (not precopy.LIVE_NAME.fullmatch(name) or name in live):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=vfd)
            except OSError as e:
                raise RuntimeFailure(f"memory file {name} of {layer.name} cannot be opened safely ({e.strerror})",
                                     hint="the workspace replaced it; the snapshot cannot be saved") from e
            try:
                st, host = os.fstat(fd), _lstat(cfg.paths.mem / name)
                if not stat.S_ISREG(st.st_mode) or host is None or (st.st_dev, st.st_ino) != (host.st_dev, host.st_ino):
                    raise RuntimeFailure(f"{name} in the layer of {layer.name} is not the memory file bunshin wrote",
                                         hint="the workspace replaced it; the snapshot cannot be saved")
                out.append(_save_memfile(fd, name, out_dir))
                live.add(name)
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
        for part in rsnap_lifetime.MEM_VIEW.strip("/").split("/"):
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


