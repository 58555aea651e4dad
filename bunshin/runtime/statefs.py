"""bunshin's tmpfs: one mount at ``Config.tmpfs`` holding every layer, upper,
snapshot image and memory file, with transparent huge pages for files large
enough to fill them (``huge=within_size``; small files keep small pages).

Huge pages matter twice for a fork. CRIU writes a dump's memory pages into the
images while the workspace is frozen: in 2 MiB page-cache units that copy is
about 3x faster (256 MiB: ~37 ms instead of ~105 ms), and it is most of the
parent's pause. And a memory file made of huge pages is mapped by clones with
one page-table entry per 2 MiB (``ShmemPmdMapped``) instead of 512: a clone that
reads its whole 256 MiB heap holds ~4 KiB of page tables for it, not ~520 KiB.

Mounted on first use when the folder is missing or empty (an existing, non-empty
folder is used as it is, without huge pages); unmounted by ``release`` once
nothing of bunshin's is left in it but caches.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..config import Config
from . import syscalls as sc

SOURCE = "bunshin"
HUGE = "huge=within_size"
_IN_USE = ("workspaces", "snapshots")  # folders whose entries mean "in use"


def ensure(cfg: Config) -> bool:
    """Mount bunshin's tmpfs at ``cfg.tmpfs`` if it is not there; True if it has huge pages."""
    path = cfg.tmpfs
    if os.path.ismount(path):
        return HUGE in (options(path) or "")
    if path.is_dir() and any(path.iterdir()):
        return False  # someone's files already: use the folder as it is
    path.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(path.parent)
    size = f"size={st.f_blocks * st.f_frsize}"  # as large as the tmpfs it replaces
    for opts in (f"mode=0755,{size},{HUGE}", f"mode=0755,{size}"):  # no shmem THP: plain tmpfs
        try:
            sc.mount(SOURCE, str(path), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, opts)
            return HUGE in opts
        except OSError:
            continue
    return False


def release(cfg: Config) -> bool:
    """Unmount bunshin's tmpfs if no workspace or snapshot is left in it; True if it went.

    What it still holds are caches (the agent and mask layers), rebuilt on next use.
    """
    path = cfg.tmpfs
    if not os.path.ismount(path) or options(path) is None or mounts_under(path):
        return False
    if any(any((path / d).iterdir()) for d in _IN_USE if (path / d).is_dir()):
        return False
    try:
        sc.umount(str(path))
    except OSError:
        return False  # busy: something still has a file open in it
    shutil.rmtree(path, ignore_errors=True)  # the empty mount point
    return True


def options(path: Path) -> str | None:
    """The superblock options of the mount at ``path`` (None if it is not a mount point)."""
    target = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == target:
                found = fields[-1]  # the last mount on a point is the visible one
    return found


def mounts_under(folder: Path) -> list[str]:
    """Mount points strictly below ``folder``."""
    base = os.path.realpath(folder) + "/"
    with open("/proc/self/mountinfo") as f:
        return [t for t in (line.split()[4] for line in f) if t.startswith(base)]
