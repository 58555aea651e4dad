"""Fencing: which epoch of each host the cluster still owns, kept in Ray's GCS.

Every host name has an epoch (``epoch/NAME`` in the GCS's key-value store, namespace
``bunshin``). The head fences a host it gave up on (:func:`fence`: the epoch moves on,
its trajectories were retried elsewhere). The host's actor compares the epoch its
home's state was made in (the home's :class:`~bunshin.runtime.gc.ClusterLease`) with
the cluster's, at start and every :data:`RENEW_S` seconds: a fenced home is emptied
and served again in the new epoch (then ``serving/NAME`` says so, and the head may
place there again). While the cluster vouches for the home its lease is renewed; a
lease nobody renews runs out, and plain ``bunshin gc`` on that host then removes what
it held (:mod:`bunshin.runtime.gc`).
"""

from __future__ import annotations

from typing import Any

NAMESPACE = "bunshin"
#: How often a host actor renews its lease and looks for a fence.
RENEW_S = 1.0
#: How long a lease lasts unrenewed (a host cut off from the cluster that long is given up).
LEASE_S = 30.0


def _kv() -> Any:
    """Ray's GCS key-value store: Ray has no public one; its own libraries (Serve, the job
    manager) use this module."""
    from ray.experimental import internal_kv

    return internal_kv


def _get(key: str) -> int | None:
    v = _kv()._internal_kv_get(key, namespace=NAMESPACE)  # noqa: SLF001 (see _kv)
    return None if v is None else int(v)


def _put(key: str, value: int) -> None:
    _kv()._internal_kv_put(key, str(value), overwrite=True, namespace=NAMESPACE)  # noqa: SLF001


def epoch(name: str) -> int | None:
    """The epoch the cluster owns of host ``name`` (``None``: it never had one)."""
    return _get(f"epoch/{name}")


def set_epoch(name: str, value: int) -> None:
    _put(f"epoch/{name}", value)


def fence(name: str) -> int:
    """Give host ``name``'s current epoch up; the new epoch (one head fences at a time)."""
    new = (epoch(name) or 0) + 1
    set_epoch(name, new)
    return new


def serving(name: str) -> int | None:
    """The epoch host ``name`` serves now, emptied of everything older."""
    return _get(f"serving/{name}")


def set_serving(name: str, value: int) -> None:
    _put(f"serving/{name}", value)
