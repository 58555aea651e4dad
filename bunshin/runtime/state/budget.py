"""The host-wide pids budget: what all of a home's workspaces may take together.

A workspace's ``pids.max`` bounds its tasks (processes *and* threads), but nothing bounded
the limits together: ``kernel.pid_max`` (32768 here) is the machine's whole pid space, and
a few workspaces each filling its own limit (a fork bomb, a runaway thread pool: 3,000
threads from one 256 MiB workspace) could take the pids the host needs. So the sum of
the pids limits of a home's live workspaces (every state but ``dead``) stays within
``pid_max`` less :data:`PID_MARGIN` of it, kept for the host itself; a workspace without
a pids limit counts as the whole budget.

Each new workspace's record is added to the store in the same transaction as the check
(:func:`add_within`: ``BEGIN IMMEDIATE``), so two callers, also in two processes, never
both take the last room: a create is refused before anything is made, a restore's
clone is refused and the batch rolled back (all or none). ``snapshot.check_batch`` asks
:func:`check_room` for the whole batch first, so a fork that cannot fit is refused
before its dump. A raised ``kernel.pid_max`` (up to :data:`PID_MAX_LIMIT`) raises the
budget at once. Only this home's records are counted: another home is another budget.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import InvalidArgument, ResourceExhausted
from .records import WorkspaceRecord
from .store import Store

#: Share of ``kernel.pid_max`` the workspaces' limits leave to the host.
PID_MARGIN = 0.1
#: The largest ``kernel.pid_max`` a 64-bit kernel takes (``PID_MAX_LIMIT``, 4 Mi).
PID_MAX_LIMIT = 1 << 22
#: Smallest pids limit a workspace may get: its agent needs a few tasks.
MIN_PIDS = 8
_RAISE = "sysctl -w kernel.pid_max=4194304"


def pid_max() -> int:
    """``kernel.pid_max``: one more than the largest pid the kernel gives."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768  # the kernel's default


def pids_budget() -> int:
    """What the pids limits of all live workspaces may add up to."""
    return int(pid_max() * (1 - PID_MARGIN))


def check_pids_limit(pids: object) -> int | None:
    """``pids`` if it is a limit one workspace may have (a whole number from :data:`MIN_PIDS`
    to :func:`pids_budget`, or None: none), else ``InvalidArgument``."""
    if pids is None:
        return None
    if isinstance(pids, bool) or not isinstance(pids, int):
        raise InvalidArgument(f"pids limit {pids!r} is not a whole number", hint="give e.g. 512")
    budget = pids_budget()
    if pids < MIN_PIDS:
        raise InvalidArgument(f"pids limit {pids} is too small", hint=f"give at least {MIN_PIDS} (the agent needs a few)")
    if pids > budget:
        raise InvalidArgument(f"pids limit {pids} is more than this host's budget for all workspaces together "
                              f"({budget}: kernel.pid_max {pid_max()} less {PID_MARGIN:.0%} kept for the host)",
                              hint=f"give at most {budget}, or raise kernel.pid_max ({_RAISE})")
    return pids


def pids_taken(store: Store) -> int:
    """The pids limits of the store's live workspaces, added up (no limit: the whole budget)."""
    budget = pids_budget()
    return sum(budget if n is None else n for n in store.live_pids_limits())


def check_room(store: Store, pids: int | None, count: int = 1) -> None:
    """``ResourceExhausted`` unless ``count`` more workspaces of ``pids`` each fit the budget."""
    budget = pids_budget()
    taken = pids_taken(store)
    need = count * (budget if pids is None else pids)
    if taken + need > budget:
        left = max(budget - taken, 0)
        each = "no pids limit (the whole budget)" if pids is None else f"a pids limit of {pids}"
        raise ResourceExhausted(
            f"{count} more workspace{'s' if count != 1 else ''} of {each} would pass this host's pids budget: "
            f"the live workspaces' limits add up to {taken} of {budget} (kernel.pid_max {pid_max()} less "
            f"{PID_MARGIN:.0%} kept for the host), {left} left",
            hint=f"remove workspaces, give smaller pids limits (at most {left // max(count, 1)} each now), "
                 f"or raise kernel.pid_max ({_RAISE})",
            budget=budget, taken=taken)


def add_within(store: Store, rec: WorkspaceRecord) -> None:
    """Add ``rec`` (a new workspace, before anything of it is made) if its pids limit fits the
    budget, checked and added in one transaction; else ``ResourceExhausted``, nothing added."""
    with store.transaction():
        check_room(store, rec.pids_limit)
        store.add_workspace(rec)
