"""The server's one budget for every upload in flight (snapshots, image layers, file bodies,
SWE-ReX uploads): a cap on their bytes together, and the disk's room for what they still write."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import PayloadTooLarge, RateLimited, ResourceExhausted
from .admission import CAP_RETRY_S

#: Free space uploads leave on the home's disk, at least.
DISK_MARGIN = 256 << 20


class Uploads:
    """One budget for every upload in flight on this server: snapshot loads, image layers,
    file bodies and SWE-ReX uploads. Together they hold at most ``cap`` bytes
    (``Limits.max_upload``, ``bunshin serve --max-upload``), and the disk under each must
    keep room for what all of them still write (``factor``: an upload's bytes on disk per
    byte received, 2 for a snapshot, whose tar is unpacked beside it) plus
    ``DISK_MARGIN``: concurrent uploads no longer each see the whole disk as theirs.
    Thread-safe."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._open: set[UploadBudget] = set()

    @contextmanager
    def open(self, folder: Path, *, what: str = "snapshot", factor: int = 1) -> Iterator[UploadBudget]:
        """A new upload into ``folder``, in the budget until the block ends."""
        up = UploadBudget(self, folder, what, factor)
        with self._lock:
            self._open.add(up)
        try:
            yield up
        finally:
            with self._lock:
                self._open.discard(up)

    def grow(self, up: UploadBudget, size: int) -> None:
        """Let ``up`` grow to ``size`` bytes, or raise (see :meth:`UploadBudget.check`)."""
        with self._lock:
            others = [u for u in self._open if u is not up]
            held = sum(u.size for u in others)
            if self.cap is not None and size > self.cap:
                raise PayloadTooLarge(
                    f"{up.what} upload of {size} bytes or more: over this server's limit of {self.cap}",
                    hint=f"raise it with `bunshin serve --max-upload SIZE`, or move a smaller {up.what}")
            if self.cap is not None and held + size > self.cap:
                raise RateLimited(
                    f"{up.what} upload of {size} bytes or more: with the {len(others)} uploads in flight "
                    f"({held} bytes) it passes this server's limit of {self.cap}",
                    hint="retry once they are done", retry_after=CAP_RETRY_S, cap="upload")
            st = os.statvfs(up.folder)
            free = st.f_bavail * st.f_frsize - DISK_MARGIN
            still = sum((u.factor - 1) * u.size for u in others) + up.factor * size - up.size
            if still > free:
                raise ResourceExhausted(
                    f"{up.what} upload of {size} bytes or more: the disk under {up.folder} has "
                    f"{max(free, 0)} bytes free past its {DISK_MARGIN >> 20} MiB spare, and the uploads in flight "
                    f"(this one and its unpacked copy included) still need {still}",
                    hint="free space on the server's BUNSHIN_HOME disk (`bunshin gc`), wait for the uploads "
                         "in flight, or place the group on another host")
            up.size = size


class UploadBudget:
    """One upload in :class:`Uploads`: ``check(size)`` before its body grows to ``size`` bytes."""

    def __init__(self, uploads: Uploads, folder: Path, what: str, factor: int) -> None:
        self.uploads, self.folder, self.what, self.factor = uploads, folder, what, factor
        self.size = 0

    def check(self, size: int) -> None:
        """Grow to ``size`` bytes, or raise (nothing changed): ``PayloadTooLarge`` (413) past
        the cap alone, ``RateLimited`` (429) past it with the others in flight,
        ``ResourceExhausted`` (507) past the disk."""
        if size > self.size:
            self.uploads.grow(self, size)
