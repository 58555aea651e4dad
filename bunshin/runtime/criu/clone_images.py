"""A clone's own folder of its snapshot's CRIU images: the same files, its own user
namespace map.

CRIU makes a restored tree's user namespace and writes its uid and gid maps from the
images (``userns-ID.img``); every clone maps its ids onto a range of its own
(``idranges``), so each restore reads a folder of symlinks to hard links to the snapshot's images
(``CLONE_PREFIX`` + the clone's id, in the images folder: same filesystem, seen by the
restore's criu with it; ~30 links for a small tree, a fraction of a millisecond; symlinks
would not do: the restored task opens some images after it pivots into the clone's root)
with a ``userns`` image of its own. It is removed after the restore (``drop``). A snapshot keeps the map of the layers' range
(``Config.id_base``: ``canonical``), whichever workspace it was taken of, so a saved
snapshot reads the same as before and a loaded one is checked against that range
(``image_policy``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ...config import Config
from ..memfile.criu_images import load, save
from . import userns_owner

_USERNS = "userns-"
CLONE_PREFIX = ".clone-"
# What a restore writes into its images folder (its log, its statistics) is its own.
_OWN = ("stats-restore",)


def _remap(path: Path, dest: Path, base: int) -> None:
    image = load(path)
    for entry in image["entries"]:
        for key in ("uid_map", "gid_map"):
            for extent in entry.get(key, []):
                extent["lower_first"] = base
    save(image, dest)


def canonical(cfg: Config, images: Path) -> None:
    """Map the dump's user namespace onto the layers' range (``Config.id_base``)."""
    for path in images.glob(f"{_USERNS}*.img"):
        _remap(path, path, cfg.id_base)


def make(images: Path, ws_id: str, host_base: int) -> Path:
    """The images folder of the clone ``ws_id``: ``images``' files (logs and other folders
    left out) with the user namespace mapped onto ``host_base``.. and owned by it
    (``userns_owner``)."""
    dest = images / f"{CLONE_PREFIX}{ws_id}"
    dest.mkdir(mode=0o755)
    src = os.open(images, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with os.scandir(src) as it:
            for e in it:
                if e.name.endswith(".log") or e.name in _OWN or not e.is_file(follow_symlinks=False):
                    continue
                if e.name.startswith(_USERNS):
                    _remap(images / e.name, dest / e.name, host_base)
                else:
                    os.link(e.name, e.name, src_dir_fd=src, dst_dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)
        os.close(src)
    userns_owner.write(dest, host_base)
    return dest


def drop(folder: Path, keep: Path | None = None) -> Path | None:
    """Remove a clone's images folder (``make``) after its restore; ``keep`` (its log) is
    moved up into the snapshot's images folder first. Where ``keep`` is now."""
    kept = None
    if keep is not None and keep.parent == folder:
        kept = folder.parent / keep.name
        with contextlib.suppress(OSError):
            os.rename(keep, kept)
    shutil.rmtree(folder, ignore_errors=True)
    return kept


def folders(images: Path) -> list[str]:
    """The clone folders in ``images`` (each named ``CLONE_PREFIX`` + a clone's id)."""
    with contextlib.suppress(OSError), os.scandir(images) as it:
        return [e.name for e in it if e.name.startswith(CLONE_PREFIX)]
    return []


def sweep(images: Path, found: list[str], live: set[str]) -> list[str]:
    """Remove the clone folders ``found`` in ``images`` (``folders``) of clones not in
    ``live`` (a restore that died). ``found`` is listed before ``live`` is read: a clone's
    record is written before its folder, so a restore under way is in ``live``."""
    out = []
    for name in found:
        if name[len(CLONE_PREFIX):] not in live:
            shutil.rmtree(images / name, ignore_errors=True)
            out.append(str(images / name))
    return out
