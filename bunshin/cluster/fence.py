"""Fencing: which epoch of each host the cluster still owns, kept in Ray's GCS, signed.

Every host name has an epoch (``epoch/NAME`` in the GCS's key-value store, namespace
``bunshin``). The head fences a host it gave up on (:func:`fence`: the epoch moves on,
its trajectories were retried elsewhere). The host's actor compares the epoch its
home's state was made in (the home's :class:`~bunshin.runtime.upkeep.gc.ClusterLease`) with
the cluster's, at start and every :data:`RENEW_S` seconds: a fenced home is emptied
and served again in the new epoch (then ``serving/NAME`` says so, and the head may
place there again). While the cluster vouches for the home its lease is renewed; a
lease nobody renews runs out, and plain ``bunshin gc`` on that host then removes what
it held (:mod:`bunshin.runtime.upkeep.gc`).

A record empties a host, so it counts only if it is signed: ``EPOCH:MAC``, the MAC
(HMAC-SHA256 with the cluster secret's fencing key, :mod:`bunshin.cluster.secret`)
over its kind, host and epoch. Anyone else who reaches Ray's key-value store (a driver
without the secret) can write there, but what they write is ignored and counted
(:func:`rejected`, a host's ``status``); a signed record copied to another host's key
fails too, and an older signed one (replayed) never moves a host back: a host follows
only an epoch newer than its own.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ..errors import Unauthorized
from .secret import ClusterSecret

log = logging.getLogger(__name__)
NAMESPACE = "bunshin"
#: How often a host actor renews its lease and looks for a fence.
RENEW_S = 1.0
#: How long a lease lasts unrenewed (a host cut off from the cluster that long is given up).
LEASE_S = 30.0
_rejected: Counter[str] = Counter()  # key -> records ignored in this process (unsigned, forged, replayed)


def _kv() -> Any:
    """Ray's GCS key-value store: Ray has no public one; its own libraries (Serve, the job
    manager) use this module."""
    from ray.experimental import internal_kv

    return internal_kv


def _get(key: str) -> str | None:
    v = _kv()._internal_kv_get(key, namespace=NAMESPACE)  # noqa: SLF001 (see _kv)
    return None if v is None else v.decode(errors="replace")


def _put(key: str, value: str) -> None:
    _kv()._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)  # noqa: SLF001


def reject(key: str, why: str) -> None:
    """Count (and log) a record that is not the cluster's."""
    _rejected[key] += 1
    if _rejected[key] == 1 or _rejected[key] % 100 == 0:
        log.error("ignored %s in Ray's key-value store (%s; %d time(s)): someone without the cluster secret "
                  "reaches Ray (see the README's cluster network)", key, why, _rejected[key])


def rejected() -> int:
    """How many records this process ignored."""
    return sum(_rejected.values())


def _read(secret: ClusterSecret, kind: str, name: str) -> int | None:
    """The signed value of ``kind/name``; ``None`` if there is none, or it is not signed
    with this cluster's secret (then reported)."""
    key = f"{kind}/{name}"
    raw = _get(key)
    if raw is None:
        return None
    value, _, mac = raw.partition(":")
    try:
        epoch = int(value)
    except ValueError:
        epoch = None
    if epoch is None or not mac or not secret.verify(mac, kind, name, epoch):
        reject(key, "not signed with the cluster secret")
        return None
    return epoch


def _write(secret: ClusterSecret, kind: str, name: str, value: int) -> None:
    _put(f"{kind}/{name}", f"{value}:{secret.sign(kind, name, value)}")


def epoch(secret: ClusterSecret, name: str) -> int | None:
    """The epoch the cluster owns of host ``name`` (``None``: it never had one, or what
    is there is not signed)."""
    return _read(secret, "epoch", name)


def set_epoch(secret: ClusterSecret, name: str, value: int) -> None:
    _write(secret, "epoch", name, value)


def fence(secret: ClusterSecret, name: str) -> int:
    """Give host ``name``'s current epoch up; the new epoch (one head fences at a time).
    A record there that is not signed is not built on: :class:`Unauthorized`."""
    key = f"epoch/{name}"
    current = epoch(secret, name)
    if current is None and _get(key) is not None:
        raise Unauthorized(f"{key} in Ray's key-value store is not signed with this cluster's secret",
                           hint="someone without the secret reaches Ray: keep its network to the cluster's hosts "
                                "and turn Ray's token authentication on (see the README)")
    # past what it serves too: a record someone removed does not send it back to an old epoch
    new = max(current or 0, serving(secret, name) or 0) + 1
    set_epoch(secret, name, new)
    return new


def serving(secret: ClusterSecret, name: str) -> int | None:
    """The epoch host ``name`` serves now, emptied of everything older (``None``: not
    known, or not signed)."""
    return _read(secret, "serving", name)


def set_serving(secret: ClusterSecret, name: str, value: int) -> None:
    _write(secret, "serving", name, value)
