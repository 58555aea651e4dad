"""Addresses of workspaces with egress: a /30 of their own out of a private pool.

Slot ``k`` of the pool (``Config.net_pool``, 10.200.0.0/16 by default: 16,383 slots) is
the /30 at ``pool + 4k``: ``.1`` the host's end of the workspace's veth (its gateway and
resolver), ``.2`` the workspace's. A slot is reserved in the store (kind ``netslot``,
id = k) before its link exists, holding the workspace's id, the reserving process and
the workspace's policy, and freed with the workspace (``free``); one whose workspace and
maker are gone is swept (``sweep``), as ``idranges`` does with id ranges.

Names carry the home's tag (``tag``), so gc of one home never touches another's:
the host's end of the veth is ``bsn<tag><k in hex>`` (at most 15 characters, IFNAMSIZ),
its nftables table ``inet bunshin-<tag>-<k>``. Two homes sharing a pool are kept apart
by the link name: a slot whose link exists already (EEXIST) is another home's, and
another slot is taken.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import secrets
import sqlite3
from dataclasses import dataclass

from ...config import Config
from ...errors import InvalidArgument, ResourceExhausted
from ..state.idranges import sweep_reservations
from ..state.store import Store
from .policy import Policy

KIND = "netslot"
LINK_PREFIX = "bsn"
TABLE_PREFIX = "bunshin-"
PEER_NAME = "eth0"
_TRIES = 64


def tag(cfg: Config) -> str:
    """Four hex digits of the home, in every link and table name it makes."""
    return hashlib.sha256(str(cfg.home).encode()).hexdigest()[:4]


def pool(cfg: Config) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.IPv4Network(cfg.net_pool)
    except ValueError as e:
        raise InvalidArgument(f"network pool {cfg.net_pool!r}: {e}", hint="give an IPv4 CIDR, e.g. 10.200.0.0/16") \
            from None
    if net.prefixlen > 28 or not net.is_private:
        raise InvalidArgument(f"network pool {net} must be a private range of at least 16 addresses",
                              hint="e.g. 10.200.0.0/16")
    return net


@dataclass(frozen=True)
class Slot:
    """One workspace's addresses and names."""

    index: int
    gateway: ipaddress.IPv4Interface  # the host's end
    address: ipaddress.IPv4Interface  # the workspace's end
    link: str  # the host's end of the veth
    table: str  # its nftables table (family inet)

    @classmethod
    def of(cls, cfg: Config, index: int) -> Slot:
        net = pool(cfg)
        base = int(net.network_address) + 4 * index
        t = tag(cfg)
        return cls(index, ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 1)}/30"),
                   ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 2)}/30"),
                   f"{LINK_PREFIX}{t}{index:x}", f"{TABLE_PREFIX}{t}-{index}")


def count(cfg: Config) -> int:
    """Slots in the pool (the last /30 is left out: it holds the broadcast address)."""
    return pool(cfg).num_addresses // 4 - 1


def reserve(cfg: Config, store: Store, ws_id: str, policy: Policy, *, skip: frozenset[int] = frozenset()) -> Slot:
    """A free slot for ``ws_id``, recorded with its policy. ``skip``: indexes found taken
    by another home."""
    n = count(cfg)
    for _ in range(_TRIES):
        k = secrets.randbelow(n)
        if k in skip:
            continue
        data = json.dumps({"workspace": ws_id, "pid": os.getpid(), "policy": policy.to_dict()})
        try:
            store.insert_object(KIND, str(k), data)
        except sqlite3.IntegrityError:
            continue
        return Slot.of(cfg, k)
    raise ResourceExhausted(f"no free address for a workspace in {pool(cfg)} (tried {_TRIES} of {n})",
                            hint="remove workspaces with egress, or give Config.net_pool a larger range")


def free(store: Store, index: int | None) -> None:
    if index is not None:
        store.delete_object(KIND, str(index))


def policy_of(store: Store, index: int) -> Policy | None:
    data = store.get_object(KIND, str(index))
    return None if data is None else Policy.from_dict(json.loads(data)["policy"])


def save_policy(store: Store, index: int, policy: Policy) -> None:
    def change(data: str) -> str:
        d = json.loads(data)
        d["policy"] = policy.to_dict()
        return json.dumps(d)

    store.update_object(KIND, str(index), change)


def held(store: Store) -> dict[int, str]:
    """Reserved slots and the workspace each is for."""
    return {int(k): json.loads(d)["workspace"] for k, d in store.list_objects(KIND)}


def sweep(store: Store) -> list[int]:
    """Free reservations whose workspace has no record and whose maker is gone."""
    return [int(k) for k in sweep_reservations(store, KIND)]
