"""Saved snapshot folders on the wire: one uncompressed tar, streamed a chunk at a time.

A saved folder holds only regular files (manifest, CRIU images, layer tars, memory
files). Unpacking takes Python's ``data`` extraction filter: an archive from the
other side of a connection is untrusted (no absolute names, no ``..``, no links out
of the folder, no device nodes).
"""

from __future__ import annotations

import os
import shutil
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import InvalidArgument

#: Bytes per chunk of a streamed archive.
CHUNK = 1 << 20
MEDIA_TYPE = "application/x-tar"


def tar_chunks(folder: Path, *, remove: bool = False) -> Iterator[bytes]:
    """``folder`` as a tar, a chunk at a time (a thread writes it into a pipe, so memory
    stays at a chunk whatever the files' size); ``remove``: the folder goes afterwards,
    also when the reader stops early."""
    rfd, wfd = os.pipe()

    def write() -> None:
        try:
            with os.fdopen(wfd, "wb") as out, tarfile.open(fileobj=out, mode="w|") as tar:
                for path in sorted(folder.rglob("*")):
                    tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
        except OSError:  # the reader left (a broken pipe)
            pass

    writer = threading.Thread(target=write, name="bunshin-tar", daemon=True)
    writer.start()
    try:
        with os.fdopen(rfd, "rb") as src:
            while chunk := src.read(CHUNK):
                yield chunk
    finally:
        writer.join()
        if remove:
            shutil.rmtree(folder, ignore_errors=True)


def untar(archive: Path, folder: Path) -> None:
    """Unpack the tar file ``archive`` into the new folder ``folder`` (``data`` filter)."""
    try:
        with tarfile.open(archive, mode="r:") as tar:
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise InvalidArgument(f"not a snapshot archive: {e}",
                              hint="send the tar that GET /v1/snapshots/{id}/archive answers") from None
