"""Snapshots of running workspaces, and restores from them: the live fork.

The room: taking (the dump), restoring (clones, and ``fork``), ahead (the next clone of a
snapshot made up to its criu run), lifetime (the record and what
keeps it alive), sweeping (freeing what nothing holds); folder (a snapshot saved to or loaded
from a folder) and checks (what a loaded folder must satisfy); image_policy (what a CRIU image
may bring), upper_copy (the frozen copy of the upper, upper_copy.c), precopy (the live
pre-copy), fork_checks and unforkable (what cannot be forked, named before the freeze).

A snapshot is one ``criu dump --leave-running`` of a workspace plus a frozen copy of
its upper layer taken while its tasks are frozen (the ``post-dump`` action). In
``cow`` mode the dump is then rewritten (``memfile``) so that private anonymous
memory becomes private mappings of memory files on tmpfs: every restore maps the
same pages copy-on-write. The memory files are hard-linked into the snapshot's
layer under ``/.bunshin/mem``, which is how restored tasks (and forks of them)
see them, and nothing else does.

A restore builds a new workspace: an overlay of ``[snapshot layer, *source lowers]``
with a fresh upper, fresh cgroups with the source's limits, and ``criu restore``
into them with new namespaces. A batch of restores returns every workspace or
rolls back all of them.

Lifetime: a snapshot taken by ``fork`` lives while any workspace stacks on its
layer; one taken explicitly (``keep``) lives until removed. While a process is
still taking, forking or loading one (``owner_pid``), nothing frees it. ``sweep``
frees whatever nothing holds: records, image folders, layers and memory files,
also those no record names any more (a crash, or the ancestors of a loaded
snapshot).

May import: criu, container, agent_host, memfile, oci, kernel, state; never upkeep.
"""

from ..state.records import MADE_AHEAD
from . import ahead
from .lifetime import (
    KIND,
    MEM_VIEW,
    SnapshotRecord,
    claim,
    get,
    held_layers,
    kept_bytes,
    list_all,
    unclaim,
    update,
)
from .restoring import MAX_BATCH, PID_MARGIN, criu_mounts, fork, restore
from .sweeping import remove, sweep
from .taking import take

__all__ = [
    "KIND",
    "MADE_AHEAD",
    "MAX_BATCH",
    "MEM_VIEW",
    "PID_MARGIN",
    "SnapshotRecord",
    "ahead",
    "claim",
    "criu_mounts",
    "fork",
    "get",
    "held_layers",
    "kept_bytes",
    "list_all",
    "remove",
    "restore",
    "sweep",
    "take",
    "unclaim",
    "update",
]
