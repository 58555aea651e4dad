"""Removing many workspaces at once: each step for the whole batch, not one workspace at a time.

``container.destroy`` removes one workspace: kill, wait for its cgroup to empty,
unmount, delete. For N clones in a row that is N waits for N cgroups to empty, one
after another. ``destroy_many`` kills every process of the batch first (they exit
side by side: the kernel frees their memory in parallel), waits once for all
cgroups to empty, then unmounts (lazily: ``MNT_DETACH``), deletes folders and
cgroups, and drops the records in one transaction. Unmounts try ``umount2`` until
the kernel says "not a mount point": no read of ``/proc/self/mountinfo`` per
workspace, which grows with every clone (at 1,024 clones reading it once per
removal made removal quadratic).

Measured (``bunshin bench fork``): see README, "removal".
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import time
from collections.abc import Sequence

from ...config import Config
from ...errors import RuntimeFailure
from ..kernel import syscalls as sc
from ..net import attach as net
from ..net.policy import NetworkMode
from ..state import idranges
from ..state.records import WorkspaceRecord, WorkspaceState
from ..state.store import Store
from . import range_views
from .cgroups import WorkspaceCgroup

UMOUNT_NOFOLLOW = 8
KILL_TIMEOUT_S = 30.0


def umount_all(path: str) -> None:
    """Lazily unmount everything stacked on ``path`` (nothing if it is no mount point)."""
    for _ in range(64):
        try:
            sc.umount(path, sc.MNT_DETACH | UMOUNT_NOFOLLOW)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):
                return
            raise
    raise RuntimeFailure(f"more than 64 mounts stacked on {path}", hint="run `bunshin gc`")


def _removing(rec: WorkspaceRecord) -> WorkspaceRecord:
    return rec if rec.state == WorkspaceState.REMOVING else rec.replace(state=WorkspaceState.REMOVING)


def kill_all(cgroups: Sequence[WorkspaceCgroup], timeout: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL every process in every cgroup until all are empty (one wait for all)."""
    deadline = time.monotonic() + timeout
    pause = 0.0005
    left = list(cgroups)
    while left:
        busy = []
        for cg in left:
            pids = cg.pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if pids:
                busy.append(cg)
        left = busy
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeFailure(f"processes survive SIGKILL in {len(left)} cgroups, e.g. {left[0].paths[0]}",
                                 hint="see `ps` for tasks in uninterruptible sleep (D); then `bunshin gc`")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def destroy_many(cfg: Config, store: Store, recs: Sequence[WorkspaceRecord]) -> None:
    """Remove every workspace of ``recs``, step by step for the whole batch. Idempotent
    like ``container.destroy``; a failure leaves the records in REMOVING for ``gc``."""
    if not recs:
        return
    with store.transaction():
        recs = [store.update_workspace(r.id, _removing) or _removing(r) for r in recs]
    cgroups = [WorkspaceCgroup.of_record(r) for r in recs]
    kill_all(cgroups)
    for rec in recs:
        wdir = cfg.paths.workspace(rec.id)
        umount_all(rec.root)
        umount_all(str(wdir))
    for rec, cg in zip(recs, cgroups, strict=True):
        shutil.rmtree(cfg.paths.workspace(rec.id), ignore_errors=True)
        cg.destroy()
        if rec.network != NetworkMode.NONE:  # its link, table and slot (as ``lifecycle.destroy``)
            net.disconnect(cfg, store, rec.id)
        if rec.ids is not None:
            range_views.release(cfg, rec.ids)
    with store.transaction():
        for rec in recs:
            store.delete_workspace(rec.id)
            idranges.free(cfg, store, rec.ids)
