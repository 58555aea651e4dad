"""bunshin's tmpfs: where everything bunshin keeps in memory lives (layers, uppers,
snapshot images, memory files), mounted at ``Config.tmpfs`` on first use.

Two mounts, for huge pages where they pay and nowhere else:

- ``Config.tmpfs`` itself, ``huge=advise``: files get huge pages only where bunshin
  asks for them (the dense 2 MiB regions of memory files, see
  ``memfile.fileio.write_data``). A clone maps those with one
  page-table entry per 2 MiB: reading all of a 256 MiB heap costs it ~4 KiB of page
  tables instead of ~520 KiB. Everything else keeps small pages and the usual 4 KiB
  ``st_blksize`` (on an always-huge tmpfs it is 2 MiB, and stdio and Python then
  give every open file a 2 MiB buffer).
- ``snapshots/`` beneath it, ``huge=within_size``: CRIU's images only. CRIU writes a
  dump's pages there while the workspace is frozen; in 2 MiB page-cache units that
  copy is ~3x faster (256 MiB: ~37 ms instead of ~105 ms), most of the pause.

An existing, non-empty folder at ``Config.tmpfs`` is used as it is (no mounts, no
huge pages). ``release`` unmounts both once nothing but caches is left.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ...config import Config
from ..kernel import mountinfo
from ..kernel import syscalls as sc
from . import idmap

SOURCE = "bunshin"
ADVISE = "huge=advise"
WITHIN_SIZE = "huge=within_size"
_FLAGS = sc.MS_NOSUID | sc.MS_NODEV
_IN_USE = ("workspaces", "snapshots")  # folders whose entries mean "in use"


def images_root(cfg: Config) -> Path:
    return cfg.paths.snapshots


def own_mounts(cfg: Config) -> set[str]:
    """The mount points that are bunshin's own state (its tmpfs, the idmapped views of
    host-owned layers), not workspace mounts."""
    return {os.path.realpath(cfg.tmpfs), os.path.realpath(images_root(cfg)), *idmap.mounted(cfg)}


def ensure(cfg: Config) -> bool:
    """Mount bunshin's tmpfs (and its images tmpfs) where they are missing.

    Returns whether memory files there can be given huge pages (``huge_memfiles``).
    """
    path = cfg.tmpfs
    opts = options(path)
    if opts is None:
        if path.is_dir() and any(path.iterdir()):
            return False  # someone's files already: use the folder as it is
        path.mkdir(parents=True, exist_ok=True)
        if not _mount(path, ADVISE, size=_size(path.parent)):
            return False
        opts = options(path)
    images = images_root(cfg)
    if not os.path.ismount(images):
        images.mkdir(exist_ok=True)
        if not any(images.iterdir()):
            _mount(images, WITHIN_SIZE, size=_size(path))
    return ADVISE in (opts or "")


def huge_memfiles(cfg: Config) -> bool:
    """Whether memory files under ``cfg.tmpfs`` can be given huge pages on request."""
    return ADVISE in (options(cfg.tmpfs) or "")


def release(cfg: Config) -> bool:
    """Unmount bunshin's tmpfs if no workspace or snapshot is left in it; True if it went.

    What it still holds are caches (the agent and mask layers), rebuilt on next use.
    """
    path = cfg.tmpfs
    if options(path) is None:
        # no tmpfs, but views of an earlier one may be left mounted in its folder
        # (e.g. the folder made again by a later run): they go the same way
        views = idmap.mounted(cfg)
        if views and not set(mounts_under(path)) - own_mounts(cfg):
            idmap.release(cfg)
            return not idmap.mounted(cfg)
        return False
    if set(mounts_under(path)) - own_mounts(cfg):
        return False  # a workspace's overlay is still mounted
    if any(any((path / d).iterdir()) for d in _IN_USE if (path / d).is_dir()):
        return False
    idmap.release(cfg)
    try:
        if os.path.ismount(images_root(cfg)):
            sc.umount(str(images_root(cfg)))
        sc.umount(str(path))
    except OSError:
        return False  # busy: something still has a file open in it
    shutil.rmtree(path, ignore_errors=True)  # the empty mount point
    return True


def options(path: Path) -> str | None:
    """The superblock options of the mount at ``path`` (None if it is not a mount point)."""
    found = mountinfo.at(path)
    return None if found is None else found.super_options


def mounts_under(folder: Path) -> list[str]:
    """Mount points strictly below ``folder``."""
    return mountinfo.below(folder)


def _size(fs: Path) -> int:
    st = os.statvfs(fs)
    return st.f_blocks * st.f_frsize  # as large as the tmpfs it sits on


def _mount(path: Path, huge: str, *, size: int) -> bool:
    for opts in (f"mode=0755,size={size},{huge}", f"mode=0755,size={size}"):  # no shmem THP: plain
        try:
            sc.mount(SOURCE, str(path), "tmpfs", _FLAGS, opts)
            return True
        except OSError:
            continue
    return False
