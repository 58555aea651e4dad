"""What a workspace holds that CRIU cannot carry, named after a dump failed.

Looked for only once ``criu dump`` has failed (nothing is paid on a fork that works):
the workspace's processes are walked through /proc and the first thing found that
explains the failure becomes a ``NotForkable`` naming the process (its pid inside the
workspace and its command), the object and what to do. Two kinds are known:

- a deleted-but-open regular file (a "ghost") larger than the fork's ghost limit
  (``Config.ghost_limit``, CRIU's ``--ghost-limit``): CRIU copies such a file's bytes
  into the images, up to the limit ("Can't dump ghost file ... increase limit");
- an inotify watch on a filesystem that cannot decode its file handles: CRIU records
  a watch by the path its handle opens to (``fsnotify.c``), which the workspace's root
  overlay allows (``container.EXPORT_OPTIONS``) and /proc, /dev/pts or an overlay the
  kernel mounted without ``nfs_export`` (a lower that cannot decode handles) do not
  ("fsnotify: Can't dump that handle").

A dump may also fail for a reason found here while the process let go of it
meanwhile: then nothing is found and the caller raises CRIU's own error.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator

import psutil

from ...config import Config
from ...errors import NotForkable
from ..kernel import mountinfo
from ..kernel.limits import byte_size
from .fork_checks import Task, pid_level

_WATCH = re.compile(r"^inotify wd:\S+ ino:([0-9a-f]+) sdev:([0-9a-f]+) ")
_DELETED = " (deleted)"


def ghost_limit(cfg: Config) -> int:
    """``cfg.ghost_limit`` in bytes: an int, or a number with a K, M or G suffix ("64M")."""
    return byte_size(cfg.ghost_limit, "ghost limit",
                     "set BUNSHIN_GHOST_LIMIT (or Config.ghost_limit) to bytes or e.g. 64M, 1G", units="KMG")


def _holder(host_pid: int, level: int) -> Task | None:
    """The workspace process ``host_pid`` as its owner knows it (None once it is gone)."""
    task = Task.read(host_pid, level)
    return task if psutil.pid_exists(host_pid) else None


def _level(init: int) -> int:
    try:
        return pid_level(init)
    except OSError:
        return 0


def _tree(pid: int | None) -> list[int]:
    if pid is None:
        return []
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return []


def _fds(host_pid: int) -> Iterator[tuple[int, str]]:
    """(fd, link target) of a process's open files."""
    try:
        names = os.listdir(f"/proc/{host_pid}/fd")
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            yield int(name), os.readlink(f"/proc/{host_pid}/fd/{name}")


def big_ghost(host_pid: int, limit: int) -> tuple[int, str, int] | None:
    """(fd, path, bytes) of the first deleted-but-open regular file of ``host_pid`` holding
    more than ``limit`` bytes, if any. As CRIU, what counts is what the file has allocated
    (``st_blocks``): a sparse file's holes are not copied."""
    for fd, target in _fds(host_pid):
        if not target.endswith(_DELETED):
            continue
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{host_pid}/fd/{fd}")
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 0 and st.st_blocks * 512 > limit:
                return fd, target.removesuffix(_DELETED), st.st_blocks * 512
    return None


def _kdev(major: int, minor: int) -> int:
    """The kernel's own dev_t (``MKDEV``: 20 bits of minor), as inotify's fdinfo prints ``sdev``."""
    return (major << 20) | minor


# Filesystems without export operations: open_by_handle_at(2) fails on them. (Disk
# filesystems and tmpfs decode handles: a watch on a shared host folder forks.)
_NO_HANDLES = frozenset({"proc", "devpts", "sysfs", "mqueue", "debugfs", "tracefs", "securityfs", "pstore",
                         "bpf", "cgroup", "configfs", "fusectl", "hugetlbfs", "binfmt_misc"})


def decodes_handles(m: mountinfo.MountEntry) -> bool:
    """Whether CRIU can open a watch's file handle on ``m``'s filesystem (and so record its
    path): an overlay only if mounted ``nfs_export=on`` (``container.EXPORT_OPTIONS``)."""
    if m.fs_type == "overlay":
        return "nfs_export=on" in m.super_options.split(",")
    return m.fs_type not in _NO_HANDLES


def stuck_watch(host_pid: int) -> tuple[int, int, mountinfo.MountEntry | None] | None:
    """(fd, inode, mount) of the first inotify watch of ``host_pid`` on a filesystem that
    does not decode its file handles (the mount as the process sees it, None if unknown)."""
    try:
        mounts = {_kdev(m.major, m.minor): m for m in mountinfo.read(f"/proc/{host_pid}/mountinfo")}
    except (OSError, ValueError):
        return None
    for fd, target in _fds(host_pid):
        if target != "anon_inode:inotify":
            continue
        try:
            with open(f"/proc/{host_pid}/fdinfo/{fd}", encoding="utf-8") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            w = _WATCH.match(line)
            if w is None:
                continue
            ino, sdev = int(w.group(1), 16), int(w.group(2), 16)
            m = mounts.get(sdev)
            if m is None or not decodes_handles(m):
                return fd, ino, m
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def find(cfg: Config, workspace_id: str, pid: int | None, criu_said: str) -> NotForkable | None:
    """The refusal that explains a failed dump of the workspace whose pid 1 is ``pid``
    (host pid), given what CRIU said (its error's text: a kind is looked for only if CRIU
    named it); None if nothing known is found."""
    limit = ghost_limit(cfg)
    ghosts, watches = "ghost file" in criu_said, "fsnotify" in criu_said
    tree = _tree(pid) if ghosts or watches else []
    level = _level(tree[0]) if tree else 0
    for host_pid in tree:
        ghost = big_ghost(host_pid, limit) if ghosts else None
        if ghost is not None and (who := _holder(host_pid, level)) is not None:
            fd, path, size = ghost
            return NotForkable(
                f"cannot fork {workspace_id}: process {who.pid} ({who.command}) holds the deleted file {path!r} open (fd {fd}, {_mib(size)}), "
                f"larger than the fork's ghost limit of {_mib(limit)}",
                hint="close the file in the workspace, keep it under a name until the fork, or raise "
                     "BUNSHIN_GHOST_LIMIT (Config.ghost_limit): each clone then gets its own copy of it",
                process=who.pid, command=who.command, path=path, size=size, ghost_limit=limit,
            )
        watch = stuck_watch(host_pid) if watches else None
        if watch is not None and (who := _holder(host_pid, level)) is not None:
            fd, ino, m = watch
            where = f"{m.fs_type} filesystem at {m.mount_point}" if m is not None else "a filesystem it has no mount of"
            return NotForkable(
                f"cannot fork {workspace_id}: process {who.pid} ({who.command}) has an inotify watch (fd {fd}) on inode {ino} of the {where}, "
                "which cannot decode file handles, so CRIU cannot record the watch",
                hint="watch files of the workspace's own tree instead (its root overlay carries watches), "
                     "or stop the watcher before forking",
                process=who.pid, command=who.command, inode=ino,
                filesystem=m.fs_type if m is not None else None, mount_point=m.mount_point if m is not None else None,
            )
    return None
