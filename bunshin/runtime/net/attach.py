"""A workspace's network joined to its record: a slot reserved, the link made, both undone.

The slot's reservation (``slots``) names the workspace before its link and table
exist, so whatever a crash leaves is found: by ``disconnect`` (every slot the store
holds for the workspace) or by gc (``sweep``: links and tables of slots no one holds).
"""

from __future__ import annotations

import errno
import os

from ...config import Config
from ..state.store import Store
from . import egress, resolver, slots
from .policy import Policy
from .reset import reset_outside
from .rtnl import in_netns
from .slots import Slot

_EEXIST_TRIES = 8


def connect(cfg: Config, store: Store, ws_id: str, pid: int, policy: Policy) -> Slot:
    """Give the workspace ``ws_id`` (its pid 1 or any task of its network namespace:
    ``pid``) an address, a route and NAT under ``policy``; its slot."""
    taken: set[int] = set()
    resolver.ensure(cfg, store)
    for _ in range(_EEXIST_TRIES):
        slot = slots.reserve(cfg, store, ws_id, policy, skip=frozenset(taken))
        try:
            egress.attach(cfg, slot, pid, policy)
            return slot
        except OSError as e:
            slots.free(store, slot.index)
            if e.errno != errno.EEXIST:  # another home holds this slot's link: try another
                raise
            taken.add(slot.index)
        except BaseException:
            slots.free(store, slot.index)
            raise
    raise OSError(errno.EEXIST, f"{_EEXIST_TRIES} slots in a row are held by other homes")


def prepare_clones(cfg: Config, store: Store, ws_ids: list[str], policy: Policy) -> dict[str, Slot]:
    """Slots reserved for the clones ``ws_ids`` of one restore and their tables added in
    one nftables transaction, ahead of the restores (``finish_clone`` then only makes
    each clone's link); all or none."""
    made: dict[str, Slot] = {}
    resolver.ensure(cfg, store)
    try:
        for ws_id in ws_ids:
            made[ws_id] = slots.reserve(cfg, store, ws_id, policy)
        egress.add_tables(cfg, [(slot, policy) for slot in made.values()])
    except BaseException:
        for slot in made.values():
            egress.detach(slot)
            slots.free(store, slot.index)
        raise
    return made


def finish_clone(slot: Slot, pid: int, *, reset: bool) -> None:
    """The link of a clone just restored (``prepare_clones`` made its slot and table);
    ``reset``: its images held TCP connections, and those to the outside are destroyed
    first (``reset``), before the clone has a route out. On failure the caller destroys
    the clone (``disconnect`` removes the table and any link)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if reset:
            in_netns(fd, reset_outside)
        egress.add_link(slot, fd)
    finally:
        os.close(fd)


def disconnect(cfg: Config, store: Store, ws_id: str) -> None:
    """Remove every link and table of ``ws_id`` and free its slots. Idempotent."""
    for index, owner in slots.held(store).items():
        if owner == ws_id:
            egress.detach(Slot.of(cfg, index))
            slots.free(store, index)
    resolver.stop_if_idle(store)


def slot_of(cfg: Config, store: Store, ws_id: str) -> Slot | None:
    for index, owner in slots.held(store).items():
        if owner == ws_id:
            return Slot.of(cfg, index)
    return None


def policy_of(cfg: Config, store: Store, ws_id: str) -> Policy | None:
    """The policy of ``ws_id``; None without egress."""
    slot = slot_of(cfg, store, ws_id)
    return None if slot is None else slots.policy_of(store, slot.index)


def set_policy(cfg: Config, store: Store, ws_id: str, policy: Policy) -> Slot | None:
    """Change the policy of a running workspace (its table and its stored slot); None if
    it has no way out."""
    slot = slot_of(cfg, store, ws_id)
    if slot is None:
        return None
    old = slots.policy_of(store, slot.index)
    egress.set_policy(cfg, slot, policy, keep_named=old is not None and policy.keeps_names_of(old))
    slots.save_policy(store, slot.index, policy)
    return slot


def sweep(cfg: Config, store: Store) -> list[str]:
    """Free slots of workspaces that are gone, then remove the links and tables of this
    home that no slot holds; what was removed."""
    slots.sweep(store)
    removed = egress.sweep(cfg, set(slots.held(store)))
    resolver.stop_if_idle(store)
    return removed
