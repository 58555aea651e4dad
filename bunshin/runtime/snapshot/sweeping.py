"""Freeing snapshots nothing holds: records, image folders, layers and memory files, also
those no record names any more (a crash, or the ancestors of a loaded snapshot).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ...config import Config
from ...errors import (
    SnapshotNotFound,
)
from .. import memfile
from ..criu import (
    clone_images,
)
from ..kernel import syscalls as sc
from ..state.store import Store
from . import precopy
from .lifetime import KIND, MEM_VIEW, SnapshotRecord, _retained, held_layers, list_all, update


def remove(cfg: Config, store: Store, snap: SnapshotRecord) -> None:
    """Drop an explicit snapshot; its files go once no workspace stacks on it."""
    if update(store, snap.id, keep=False) is None:
        raise SnapshotNotFound(f"no snapshot {snap.id!r}", hint="`bunshin tree` lists snapshots")
    sweep(cfg, store)


def sweep(cfg: Config, store: Store) -> list[str]:
    """Delete every snapshot nothing holds, then files no record names; returns what went.

    A snapshot whose maker died half-way (``owner_pid`` dead) goes too, unless
    workspaces already stack on it.
    """
    held = held_layers(store)
    freed = []
    for s in list_all(store):
        if not _retained(s) and s.layer not in held:
            _delete(cfg, store, s)
            freed.append(s.id)
    return freed + _sweep_orphans(cfg, store)


def _sweep_orphans(cfg: Config, store: Store) -> list[str]:
    """Remove snapshot layers, image folders and memory files that no record names.

    Records are always written before the files they name, so anything unnamed is
    left over (from a crash, or the ancestor layers of a removed loaded snapshot).
    The files are listed *before* the records are read: a snapshot being taken
    concurrently has its record in place by the time its files can be seen.
    """
    layers, sdir, mdir = cfg.paths.layers, cfg.paths.snapshots, cfg.paths.mem
    layer_dirs = sorted(layers.glob("snap-*")) if layers.is_dir() else []
    image_dirs = sorted(sdir.iterdir()) if sdir.is_dir() else []
    mem_files = sorted(mdir.glob(f"*{memfile.SUFFIX}")) if mdir.is_dir() else []
    all_layers = {d.name for d in layers.iterdir()} if layers.is_dir() else set()
    snaps = list_all(store)
    named = {Path(p).name for p in held_layers(store)}
    named.update(Path(p).name for s in snaps for p in (s.layer, *s.lowers))
    ids = {s.id for s in snaps}
    clone_dirs = [(Path(s.images), clone_images.folders(Path(s.images))) for s in snaps]  # before ``live``
    freed: list[str] = []
    for d in layer_dirs:
        if d.name not in named and d.name not in ids:
            remove_layer(d)
            freed.append(str(d))
    live = {r.id for r in store.list_workspaces()}
    for d in image_dirs:
        if d.name not in ids:
            shutil.rmtree(d, ignore_errors=True)
            freed.append(str(d))
    for images, found in clone_dirs:  # a clone's images folder its restore left (``clone_images``)
        freed += clone_images.sweep(images, found, live)
    tags = ids | named | (all_layers - {Path(f).name for f in freed})
    for f in mem_files:
        if memfile_tag(f.name) not in tags and not precopy.sweep_keeps(f, live):
            memfile.remove_memfile(f)
            freed.append(str(f))
    return freed


def memfile_tag(name: str) -> str:
    """The snapshot id a memory file was written for (``<snap id>-<pid>.bunshin-mem``)."""
    return name.removesuffix(memfile.SUFFIX).rsplit("-", 1)[0]


def remove_layer(layer: Path) -> None:
    """Delete a frozen layer: the links in its ``/.bunshin/mem`` (memory files are
    immutable: their flag goes first), then the folder.

    A layer that failed half-way in ``take`` still holds what the workspace left there,
    so only regular files reached through ``O_NOFOLLOW`` folder descriptors are opened;
    a symlink (to a host folder at ``/.bunshin`` or ``mem``, or named like a memory file
    and pointing at a host file) is unlinked as itself or skipped, never followed.
    """
    try:
        fd = sc.open_dir_beneath(layer, Path(MEM_VIEW).relative_to("/").parts)
    except OSError:
        fd = None
    if fd is not None:
        try:
            for name in os.listdir(fd):
                with contextlib.suppress(OSError):
                    memfile.remove_memfile_at(fd, name)
        finally:
            os.close(fd)
    shutil.rmtree(layer, ignore_errors=True)  # by descriptors: a symlink inside is unlinked, not followed


def _delete(cfg: Config, store: Store, snap: SnapshotRecord) -> None:
    """Free a snapshot's files and its record. Only paths where bunshin puts them are
    touched (a record may come from a loaded folder, which is untrusted input)."""
    mdir = cfg.paths.mem
    for f in snap.memfiles:
        if Path(f).parent == mdir and Path(f).name.endswith(memfile.SUFFIX):
            memfile.remove_memfile(Path(f))
    layer, sdir = Path(snap.layer), Path(snap.images).parent
    if layer.parent == cfg.paths.layers and layer.name not in ("", ".", ".."):
        remove_layer(layer)
    if sdir.parent == cfg.paths.snapshots and sdir.name not in ("", ".", ".."):
        shutil.rmtree(sdir, ignore_errors=True)
    store.delete_object(KIND, snap.id)
