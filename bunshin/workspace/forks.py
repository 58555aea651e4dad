"""What a fork returns: the clones, as a list, and the fork's timings with them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..runtime.snapshot import SnapshotRecord
from ..runtime.state.records import SnapshotMode

W = TypeVar("W")


@dataclass(frozen=True)
class ForkTimings:
    """One fork's costs: the parent's pause (frozen from CRIU's freeze to its thaw), the
    dump and the memory-file rewrite inside it, the memory files written, and each
    clone's restore (milliseconds, in the clones' order; ``None`` where not measured)."""

    snapshot: str
    mode: SnapshotMode
    pause_ms: float
    dump_ms: float
    rewrite_ms: float
    memfile_bytes: int
    restore_ms: tuple[float | None, ...]

    @classmethod
    def of(cls, snap: SnapshotRecord, restore_ms: Iterable[float | None]) -> ForkTimings:
        return cls(snap.id, SnapshotMode(snap.mode), snap.pause_ms, snap.dump_ms, snap.rewrite_ms,
                   snap.memfile_bytes, tuple(restore_ms))


class ForkResult(list[W], Generic[W]):
    """The clones of one fork, a plain list (as before), with ``timings``: :class:`ForkTimings`."""

    def __init__(self, clones: Iterable[W], timings: ForkTimings) -> None:
        super().__init__(clones)
        self.timings = timings
