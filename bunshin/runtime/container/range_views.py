"""A workspace's views of its layers, upper and shared folders, idmapped to its own host
id range (``idranges``).

On disk everything a workspace writes is owned by ``Config.id_base``.. (range 0) and
host-made files by host root. A workspace whose root is host uid ``B`` sees:

- frozen (snapshot) layers and image-store layers through one view each of their
  folders (``idmap.LAYERS_VIEW``, ``IMAGES_VIEW``), and its upper through a writable
  view of its own folder (``UPPER_VIEW``), all mapping ``id_base``.. to ``B``.. and host
  root to itself (``storage_map``): what it writes lands as ``id_base``.. again, so a
  frozen upper, a snapshot layer and a fork of a fork need no chown, and the host's
  own files (``/.bunshin``, memory files) stay host root's;
- host-owned layers (the host's /, a root filesystem folder, mask layers) and
  read-only shared folders through a view mapping host ids 0.. to ``B``..
  (``idmap.host_map``), as before; the agent layer as it is.

Overlayfs takes idmapped lower and upper layers (Linux >= 5.19). All views of a range
are mounted under ``idmap.range_dir`` when the workspace is made and unmounted when it
goes (``release``); ``sweep`` unmounts those of ranges no workspace holds.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from ...config import Config
from ..kernel import syscalls as sc
from ..state.records import Mount
from . import idmap

UPPER_VIEW = "v"  # in the workspace's folder: its view, holding upper/ and work/


def storage_map(cfg: Config, host_base: int) -> str:
    """Host root stays itself; the layers' range ``id_base``.. shows as ``host_base``.."""
    return f"0 0 1\n{cfg.id_base} {host_base} {cfg.id_count}\n"


def _named(layer: Path, prefix: str = "") -> str:
    digest = hashlib.sha256(str(layer).encode()).hexdigest()[:12]
    return f"{prefix}{layer.name or 'root'}-{digest}"


class _Views:
    """The user namespaces of one range's two maps, made on first need."""

    def __init__(self, cfg: Config, host_base: int) -> None:
        self.cfg, self.base = cfg, host_base
        self.dir = idmap.range_dir(cfg, host_base)
        self._fds: dict[str, int] = {}

    def userns(self, maps: str) -> int:
        if maps not in self._fds:
            self._fds[maps] = idmap.userns_fd(maps)
        return self._fds[maps]

    def mount(self, source: Path, name: str, *, host_owned: bool, read_only: bool = True,
              walk: bool = False) -> Path:
        target = self.dir / name
        if idmap.is_mounted(target):
            return target
        self.dir.mkdir(parents=True, exist_ok=True)
        target.mkdir(exist_ok=True)
        maps = idmap.host_map(self.base, self.cfg.id_count) if host_owned else storage_map(self.cfg, self.base)
        idmap.attach_view(source, target, self.userns(maps), read_only=read_only, walk=walk)
        return target

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def overlay(cfg: Config, host_base: int, layers: Sequence[str], wdir: Path) -> tuple[list[str], Path]:
    """The overlay lowers (top first, collapsed: ``idmap.collapse``) of a workspace of range
    ``host_base`` stacking on ``layers``, and the writable view of its folder ``wdir`` (its
    upper and work folder in it: ``UPPER_VIEW``); the views are mounted where missing. Each
    of the range's two maps takes one user namespace (a fork of this process), made once."""
    own = _Views(cfg, host_base)
    try:
        out = []
        for p in layers:
            layer = Path(p)
            if layer.parent == cfg.paths.layers and not layer.name.startswith("mask-"):
                if layer.name.startswith("agent-"):
                    out.append(p)  # the host's, readable inside
                else:
                    folder = own.mount(cfg.paths.layers, idmap.LAYERS_VIEW, host_owned=False)
                    out.append(str(folder / layer.name))
            elif layer.parent == cfg.paths.image_layers:
                folder = own.mount(cfg.paths.image_layers, idmap.IMAGES_VIEW, host_owned=False)
                out.append(str(folder / layer.name))
            else:
                out.append(str(own.mount(layer, _named(layer), host_owned=True)))
        upper = wdir / UPPER_VIEW
        if not idmap.is_mounted(upper):
            upper.mkdir(exist_ok=True)
            idmap.attach_view(wdir, upper, own.userns(storage_map(cfg, host_base)), read_only=False)
        return idmap.collapse(cfg, out, host_base), upper
    finally:
        own.close()


def share(cfg: Config, host_base: int, mount: Mount) -> Path:
    """The range's view of a folder shared on purpose (``--mount``; ``idmap.share`` says how
    it is reached). Read-only: host ids 0.. show as the workspace's. Read-write: what the
    workspace writes lands as ``id_base``.. (its clones, each of another range, see it as
    their own), host root's files stay host root's, others' show as nobody inside."""
    kind = "ro" if mount.read_only else "rw"
    own = _Views(cfg, host_base)
    try:
        return own.mount(Path(mount.host), _named(Path(mount.host), f"share-{kind}-"),
                         host_owned=mount.read_only, read_only=mount.read_only, walk=True)
    finally:
        own.close()


def release(cfg: Config, host_base: int) -> None:
    """Unmount every view of the range and remove its folder."""
    _release_dir(idmap.range_dir(cfg, host_base))


def _release_dir(rdir: Path) -> None:
    try:
        names = sorted(os.listdir(rdir), key=lambda n: not n.startswith("stack-"))  # stacks first
    except FileNotFoundError:
        return
    for name in names:
        try:
            sc.umount(str(rdir / name), sc.MNT_DETACH)
        except OSError:
            pass
        try:
            os.rmdir(rdir / name)
        except OSError:
            pass
    try:
        os.rmdir(rdir)
    except OSError:
        pass


def sweep(cfg: Config, keep: set[int]) -> list[str]:
    """Unmount the views of every range but ``keep`` (first host ids); the folders that went."""
    out: list[str] = []
    try:
        names = os.listdir(cfg.paths.idmap)
    except FileNotFoundError:
        return out
    keep_dirs = {idmap.range_dir(cfg, b).name for b in keep}
    for name in names:
        if name.startswith("r") and name[1:].isdigit() and name not in keep_dirs:
            _release_dir(cfg.paths.idmap / name)
            out.append(str(cfg.paths.idmap / name))
    return out
