"""A task's image on the host its group is placed on: moved from a host holding it, by
digest, only the layers the target lacks (``bunshin.client.images.copy_image``).

The head asks the target first (``GET /v1/images/{ref}``): a host holding the image
whole needs nothing. Otherwise the first live host holding it whole (by name) sends
its signed manifest; the target records the image and answers the layers it lacks,
and only those are streamed from the holder into the target through the head. The
target checks the signature (the cluster's shared snapshot key), each layer's digest
and size, and unpacks with the image store's hostile-tar checks. No holder: nothing
is moved, and the target resolves the name itself (pulls it, or says it has none).

One move per (image, host) at a time: concurrent placements on one host wait for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..client import Client
from ..client.images import ImageCopy, copy_image
from ..errors import NotFound, Unreachable

log = logging.getLogger(__name__)
HOST_IMAGE = "host"


@dataclass(frozen=True)
class ImageMove:
    """An image moved to ``host`` from ``source``: what was sent and what was skipped."""

    image: str
    host: str
    source: str
    layers_sent: int
    layers_skipped: int
    bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"image": self.image, "host": self.host, "source": self.source, "layers_sent": self.layers_sent,
                "layers_skipped": self.layers_skipped, "bytes": self.bytes, "seconds": round(self.seconds, 3)}


@dataclass
class ImageMoves:
    """The image moves a placement made, for its counters and reports."""

    moves: list[ImageMove] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.moves)

    @property
    def layers_sent(self) -> int:
        return sum(m.layers_sent for m in self.moves)

    @property
    def layers_skipped(self) -> int:
        return sum(m.layers_skipped for m in self.moves)


class ImageMover:
    """Moves images between ``hosts`` (a placement's clients, by host name; the ones in
    ``dead`` are not asked) when a group needs one on a host."""

    def __init__(self, hosts: Mapping[str, Client], dead: set[str]) -> None:
        self.hosts, self.dead = hosts, dead
        self.done = ImageMoves()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def _holds(self, name: str, image: str) -> bool:
        try:
            return self.hosts[name].images.holds(image)
        except (NotFound, Unreachable):  # a host that does not answer holds nothing to send
            return False

    def holders(self, image: str | None) -> set[str]:
        """The live hosts holding ``image`` whole (none for the ``host`` image)."""
        if not image or image == HOST_IMAGE:
            return set()
        return {n for n in sorted(self.hosts) if n not in self.dead and self._holds(n, image)}

    def ensure(self, image: str | None, host: str) -> ImageMove | None:
        """``image`` on ``host``, moved there if it lacks it and a live host holds it; the move."""
        if not image or image == HOST_IMAGE:
            return None
        with self._guard:
            lock = self._locks.setdefault((image, host), threading.Lock())
        with lock:
            if self._holds(host, image):
                return None
            for source in sorted(self.hosts):
                if source == host or source in self.dead or not self._holds(source, image):
                    continue
                copied: ImageCopy = copy_image(self.hosts[source].images,
                                               self.hosts[host].images, image)
                move = ImageMove(image=copied.image, host=host, source=source, layers_sent=len(copied.layers_sent),
                                 layers_skipped=len(copied.layers_skipped), bytes=copied.bytes,
                                 seconds=copied.seconds)
                with self._guard:
                    self.done.moves.append(move)
                log.info("image %s moved to %s from %s: %d layer(s), %d bytes, %d skipped", image, host, source,
                         move.layers_sent, move.bytes, move.layers_skipped)
                return move
            return None
