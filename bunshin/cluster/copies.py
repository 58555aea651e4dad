"""Roots the head put on hosts, leased to it: freed by the hosts when the head is gone.

A root copy (save -> transfer -> load) made on a host for a group, or a task's root built
there, would otherwise be freed only by the head's Python object that made it: a driver
killed mid-run would leave them on every host. Each is loaded with a lease on its host's
server (``POST /v1/snapshots/load?ttl=S``, granted before the load answers, so a head
that dies right after still leaves it leased) and renewed every ``ttl / 3`` seconds
(``PUT /v1/snapshots/{id}/ttl``) while the head lives. A head that dies stops renewing,
and each host's server removes its copies once their lease has run out (its lease
sweeper, about once a second). A host the head gives up is fenced, which empties it
anyway; a copy already gone (404) is forgotten.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..errors import NotFound

if TYPE_CHECKING:
    from ..client import Client

log = logging.getLogger(__name__)
#: How long a root the head put on a host outlives the head (it is renewed every third of it).
COPY_TTL_S = 60.0


class CopyLeases:
    """The roots leased on each host (``hosts``: the placement's clients, by name; read at
    every renewal, so a host's new client after a fence is used)."""

    def __init__(self, hosts: Mapping[str, Client], *, ttl: float = COPY_TTL_S) -> None:
        self.hosts, self.ttl = hosts, ttl
        self.held: set[tuple[str, str]] = set()  # (host, snapshot id)
        self.renewals = 0  # renewals made (for tests and reports)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, host: str, snap_id: str) -> None:
        """Keep renewing ``snap_id``'s lease on ``host`` (loaded with ``ttl=self.ttl``)."""
        with self._lock:
            self.held.add((host, snap_id))
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._loop, name="bunshin-copy-leases", daemon=True)
                self._thread.start()

    def drop(self, host: str, snap_id: str) -> None:
        with self._lock:
            self.held.discard((host, snap_id))

    def renew(self) -> None:
        """Renew every lease held now; a copy gone from its host is forgotten."""
        with self._lock:
            held = sorted(self.held)
        for host, snap_id in held:
            client = self.hosts.get(host)
            if client is None:
                continue
            try:
                client.request("PUT", f"/v1/snapshots/{snap_id}/ttl", json={"ttl": self.ttl}, default_wait=False)
                self.renewals += 1
            except NotFound:
                self.drop(host, snap_id)
            except Exception as e:  # a host that does not answer: given up elsewhere, fenced
                log.debug("renewing %s on %s failed: %s", snap_id, host, e)

    def _loop(self) -> None:
        while not self._closed.wait(self.ttl / 3):
            self.renew()

    def close(self) -> None:
        """Stop renewing (what is held runs out on its hosts unless removed first)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
