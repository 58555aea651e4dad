"""A larger CPU share for a clone's cgroup while CRIU restores into it.

A restore's criu runs inside the clone's own cgroups (``criu.Placement.cgroup_procs``),
and so do the tasks it forks, which do most of the restore's work (their files, their
memory, the restorer). On two cores shared with other work that CPU time is handed out
by weight: a clone's cgroup weighs what one task of the host does, so every restore
waits its turn behind each busy process and takes longer the busier the machine is. ``boost`` gives the clone's CPU cgroup ``FACTOR`` times the default
weight (v1 ``cpu.shares``, v2 ``cpu.weight``) before criu joins it and ``settle`` puts the
default back as soon as criu has answered: the restore's few milliseconds of CPU come
first, what the clone runs afterwards weighs as any workspace. The restored tasks hold
the larger weight only between CRIU resuming them and ``settle`` (criu's answer and exit:
0.3-1 ms p50 here, a few ms on a busy machine), and nothing inside a workspace can change
its cgroup's weight (the host's files).

``BUNSHIN_RESTORE_CPU_BOOST`` sets the factor (1 or 0: off). The host's side of a restore
waits on the criu helper and on criu at each step: its threads run at ``THREAD_NICE``
while they restore (``in_thread``), as the helper does (``zygote.NICE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..container.cgroups import WorkspaceCgroup
from ..kernel import syscalls as sc
from ..kernel.limits import env_factor

ENV = "BUNSHIN_RESTORE_CPU_BOOST"
FACTOR = 8
#: the kernel's default weight: v1 ``cpu.shares``, v2 ``cpu.weight``
DEFAULT = {1: 1024, 2: 100}
FILE = {1: "cpu.shares", 2: "cpu.weight"}
_MAX = {1: 262144, 2: 10000}
#: the nice value of this process's threads that wait on a restore (``in_thread``)
THREAD_NICE = -5
T = TypeVar("T")


def factor() -> int:
    """The boost factor from ``ENV`` (default ``FACTOR``); 1 means none."""
    return env_factor(ENV, FACTOR, "restore")


def _weight_file(cg: WorkspaceCgroup) -> Path | None:
    for controller, path in cg.dirs:
        if controller == "cpu" and (path / FILE[cg.version]).exists():
            return path / FILE[cg.version]
    return None


def boost(cg: WorkspaceCgroup, by: int) -> bool:
    """Weigh ``cg``'s CPU ``by`` times the default; whether it was (False: factor 1, no CPU
    controller here, or the write refused: the restore goes on at the default weight).
    Call before anything runs in it."""
    f = _weight_file(cg) if by > 1 else None
    if f is None:
        return False
    try:
        f.write_text(str(min(DEFAULT[cg.version] * by, _MAX[cg.version])))
    except OSError:
        return False
    return True


def settle(cg: WorkspaceCgroup) -> None:
    """Back to the default weight (the cgroup may be gone: a failed restore removed it)."""
    f = _weight_file(cg)
    if f is not None:
        with contextlib.suppress(FileNotFoundError):
            f.write_text(str(DEFAULT[cg.version]))


def in_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` with this thread at ``THREAD_NICE`` (then back to its own value): a
    restore's thread waits on the helper and on criu, and each wake-up on a busy machine
    otherwise waits for a CPU behind every other task. Without CAP_SYS_NICE it runs as it is."""
    with sc.thread_nice(THREAD_NICE):
        return fn(*args)
