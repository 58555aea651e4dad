"""Snapshots in a folder of their own: ``folder_save.save`` one there, ``folder_load.load`` it back
later. This module is the folder's format and the byte copies both sides share.

A saved snapshot holds everything a restore needs except its base image (the
host's root, or an image folder, recorded by path), the agent layer (named by its
version, rebuilt by the loading host) and the mask layer (rebuilt for the loading
config: it hides that config's own state)::

    DIR/snapshot.json     format, the record, the layer stack (top first), memory files,
                          the sha256 of every file below and an HMAC of it all
    DIR/images/*.img      the CRIU images
    DIR/layers/NAME.tar   each snapshot layer (whiteouts, holes, user.* xattrs and
                          overlayfs's opaque folders kept: ``KEPT_XATTRS``),
                          its memory-file links left out
    DIR/mem/NAME          a memory file's data extents back to back (the file
                          itself is sparse and terabytes long; the extents are
                          listed in snapshot.json); a live pre-copy's file
                          (``live-<workspace>-<tag>``) once, with the top-most layer
                          linking it; loaded where this home has none of that name,
                          else the one here must hold the same bytes

A folder is untrusted input: it holds root code and CRIU images, and whoever
can write it chooses every name, path, limit and tar member in it. ``load``
therefore checks the manifest's HMAC-SHA256 (keyed by the home's
``snapshot_key_path``: only folders this home saved pass) and every file's
hash, unless the caller says ``trust``; with or without it, every id, name and
relative path is checked against a strict pattern, files are opened below the
folder without following symbolic links, tar members are inspected before GNU
tar sees them, the layer stack must have the shape ``take`` makes, the limits
are bounded by the host and sizes by free tmpfs and memory, a folder this home
did not sign stacks only on 'host', stored image layers or a folder image this home's
workspaces or snapshots use (never any host folder it names), and a layer keeps only
``KEPT_XATTRS`` (no overlayfs redirect or metacopy, no capability). Images, layer
archives and memory-file data are copied into this home's tmpfs once, hashed on
the way, and used only from there, so a folder changed during a load cannot
swap in other bytes.

``load`` copies all of it back under the config's tmpfs with the same layer and
memory-file names (the images name memory files by path), recomputes the host
paths and records the snapshot as kept. A snapshot layer already there (an
ancestor shared with another loaded snapshot) is reused.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

from ...errors import (
    InvalidArgument,
    RuntimeFailure,
)
from .checks import (
    KEPT_XATTRS,
)

MANIFEST = "snapshot.json"
_TAR_XATTRS = ["--xattrs", *(f"--xattrs-include={x}" for x in KEPT_XATTRS), "--numeric-owner"]
_CHUNK = 8 << 20


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
