"""The server's one budget for every upload in flight (snapshots, image layers, file bodies,
SWE-ReX uploads): a cap on their bytes together, and the disk's room for what they still write;
and the one way a request's body is received into it (:func:`receiving`, :func:`spooled`,
:func:`counted`)."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import IO

import anyio.to_thread
from starlette.requests import Request
from starlette.types import Message

from ..errors import PayloadTooLarge, RateLimited, ResourceExhausted
from .admission import CAP_RETRY_S
from .shares import Offload

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
    def open(self, folder: Path, *, what: str = "snapshot", factor: int = 1, limit: int | None = None,
             hint: str = "") -> Iterator[UploadBudget]:
        """A new upload into ``folder``, in the budget until the block ends; ``limit``: its own
        bytes at most (``hint`` says what to do past it)."""
        up = UploadBudget(self, folder, what, factor, limit, hint)
        with self._lock:
            self._open.add(up)
        try:
            yield up
        finally:
            with self._lock:
                self._open.discard(up)

    def in_flight(self) -> int:
        """Bytes the uploads in flight hold now."""
        with self._lock:
            return sum(u.size for u in self._open)

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

    def __init__(self, uploads: Uploads, folder: Path, what: str, factor: int, limit: int | None = None,
                 hint: str = "") -> None:
        self.uploads, self.folder, self.what, self.factor = uploads, folder, what, factor
        self.limit, self.hint = limit, hint
        self.size = 0

    def check(self, size: int) -> None:
        """Grow to ``size`` bytes, or raise (nothing changed): ``PayloadTooLarge`` (413) past
        its own ``limit`` or the cap alone, ``RateLimited`` (429) past the cap with the others
        in flight, ``ResourceExhausted`` (507) past the disk."""
        if self.limit is not None and size > self.limit:
            raise PayloadTooLarge(f"{self.what} body of {size} bytes or more: over the {self.limit} bytes "
                                  "one upload takes", hint=self.hint or "send it in smaller parts")
        if size > self.size:
            self.uploads.grow(self, size)


#: A spooled body's bytes held in memory; past them it goes on to a file of the home's disk.
SPOOL_IN_MEMORY = 1 << 20


@contextmanager
def receiving(uploads: Uploads, request: Request, folder: Path, *, limit: int, hint: str,
              what: str = "file") -> Iterator[UploadBudget]:
    """``request``'s body as an upload into ``folder`` (made 0700 if need be), in the budget
    until the block ends: its ``Content-Length`` is checked before a byte of it is read."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    with uploads.open(folder, what=what, limit=limit, hint=hint) as budget:
        declared = request.headers.get("content-length", "")
        if declared.isdigit():
            budget.check(int(declared))  # refused before a byte is read
        yield budget


@asynccontextmanager
async def spooled(uploads: Uploads, request: Request, folder: Path, *, limit: int, hint: str,
                  what: str = "file", offload: Offload | None = None) -> AsyncIterator[IO[bytes]]:
    """``request``'s whole body, spooled (``SPOOL_IN_MEMORY`` in memory, the rest in an
    unlinked file under ``folder``) and counted in the budget as it comes, then rewound:
    a slow client holds no lock and no thread while its body trickles in, and nothing is
    written where it goes before the whole body is here. The spool and its bytes in the
    budget are gone when the block ends, also when the client hangs up midway
    (``ClientDisconnect``). ``offload``: what runs its writes in a thread (a sandbox's share
    of the pool, :meth:`.shares.Shares.run`; the pool by default)."""
    with receiving(uploads, request, folder, limit=limit, hint=hint, what=what) as budget, \
            tempfile.SpooledTemporaryFile(SPOOL_IN_MEMORY, "w+b", dir=str(folder)) as spool:
        async for chunk in request.stream():
            budget.check(spool.tell() + len(chunk))
            await (offload or anyio.to_thread.run_sync)(spool.write, chunk)
        spool.seek(0)
        yield spool


def counted(request: Request, budget: UploadBudget) -> Request:
    """``request`` whose body is counted in ``budget`` (and refused past its limit) as it is
    read: for a body its reader spools itself, such as a multipart form Starlette parses."""
    seen = 0
    receive = request.receive

    async def counting() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        budget.check(seen)
        return message

    return Request(request.scope, counting)
