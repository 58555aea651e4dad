"""Workspace leases: a workspace made with a ``ttl`` is removed by the server when it runs out.

A trainer that dies, or loses its connection between asking for workspaces and
hearing back, leaves nobody to remove them; a lease bounds how long they live
(E2B's sandbox ``timeout``, renewed with ``set_timeout``). ``PUT
/v1/workspaces/{id}/ttl`` renews one from now, or lifts it (``null``). Clones take
their parent's lease length unless the fork names its own.

Leases are records in the store (``objects`` of kind ``lease``, written before the
answer goes out), so a restarted server keeps them; the server sweeps them about
once a second (:data:`SWEEP_EVERY_S`) and removes what expired, as ``DELETE`` does
(not waiting for a call in flight). A lease whose workspace is already gone is
dropped.

Snapshots loaded with a ``ttl`` (``POST /v1/snapshots/load?ttl=S``: a cluster head's root
copies) have leases of their own (kind ``snapshot-lease``, :func:`snapshot_leases`),
renewed with ``PUT /v1/snapshots/{id}/ttl``: a head that dies stops renewing, and its
copies go.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from ..config import Config
from ..errors import NotFound
from ..runtime.state.store import Store
from ..workspace import Snapshot, Workspace

log = logging.getLogger("bunshin.server")

KIND = "lease"
SNAPSHOT_KIND = "snapshot-lease"
#: How often the server looks for expired leases.
SWEEP_EVERY_S = 1.0


@dataclass(frozen=True)
class Lease:
    """``ttl`` seconds long; ends at ``expires_at`` (epoch seconds) unless renewed."""

    ttl: float
    expires_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Lease:
        return cls(**json.loads(text))


class Leases:
    """The leases of one server's workspaces (or, with ``kind``/``remove``, of other
    objects): the store's records, mirrored in memory."""

    def __init__(self, config: Config, *, kind: str = KIND, remove: Callable[[str], None] | None = None) -> None:
        self._config = config
        self._kind = kind
        self._remove = remove or (lambda ws_id: Workspace.get(ws_id, config=config).remove())
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] | None = None  # read from the store on first use

    def get(self, ws_id: str) -> Lease | None:
        """One workspace's lease (read on every answer that shows a workspace: no copy)."""
        with self._lock:
            if self._leases is None:
                with Store.open(self._config.db_path) as store:
                    self._loaded(store)
            assert self._leases is not None
            return self._leases.get(ws_id)

    def grant(self, ws_ids: Iterable[str], ttl: float | None) -> None:
        """Lease each of ``ws_ids`` for ``ttl`` seconds from now; ``None``: lift their leases."""
        ids = list(ws_ids)
        lease = Lease(ttl, time.time() + ttl) if ttl is not None else None
        with self._lock, Store.open(self._config.db_path) as store, store.transaction():
            leases = self._loaded(store)
            for ws_id in ids:
                if lease is None:
                    store.delete_object(self._kind, ws_id)
                    leases.pop(ws_id, None)
                else:
                    store.put_object(self._kind, ws_id, lease.to_json())
                    leases[ws_id] = lease

    def drop(self, ws_id: str) -> None:
        self.grant([ws_id], None)

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove every workspace whose lease ended before ``now``; their ids."""
        now = time.time() if now is None else now
        gone = [ws_id for ws_id, lease in self._all().items() if lease.expires_at <= now]
        for ws_id in gone:
            try:
                self._remove(ws_id)
                log.info("%s: its lease ran out; removed", ws_id)
            except NotFound:
                pass
            except Exception as e:  # the next sweep tries again
                log.warning("%s: its lease ran out, but removing it failed: %s", ws_id, e)
                continue
            self.drop(ws_id)
        return gone

    def _all(self) -> dict[str, Lease]:
        with self._lock:
            if self._leases is None:
                with Store.open(self._config.db_path) as store:
                    return dict(self._loaded(store))
            return dict(self._leases)

    def _loaded(self, store: Store) -> dict[str, Lease]:
        """The leases (caller holds ``_lock``), read from ``store`` the first time."""
        if self._leases is None:
            self._leases = {ws_id: Lease.from_json(raw) for ws_id, raw in store.list_objects(self._kind)}
        return self._leases


def snapshot_leases(config: Config) -> Leases:
    """The leases of a server's snapshots loaded with a ``ttl``."""
    return Leases(config, kind=SNAPSHOT_KIND, remove=lambda snap_id: Snapshot.get(snap_id, config=config).remove())
