"""The owner of a clone's user namespace: its own root's host uid, not host root's.

CRIU's restore makes the clone's user namespace (``clone3`` with ``CLONE_NEWUSER``), and
the kernel makes the creator's euid its owner: what the clone's processes hold of every
per-owner budget (inotify instances and watches, POSIX message queue bytes, pending
signals, processes: ``idranges``) would be host root's, shared with every other clone
and with host root itself. criu must stay root for the rest of the restore (CRIU takes a
non-zero euid as ``--unprivileged``, and writes the UTS namespace's sysctls, which only
euid 0 may write). So ``userns_owner.c`` is loaded into the restore's criu (``ld.so
--preload``, or ``LD_PRELOAD`` for a criu run as a script): its ``syscall`` runs that one
``clone3`` with the euid and egid read from ``OWNER_FILE`` in criu's working folder (the
clone's images folder, ``clone_images.make``), keeping every capability, and puts criu
back to root at once. ``owner_of`` reads a namespace's owner back: a restore checks it.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from ...config import INSTALL_DIR, Config
from ..kernel import cbuild

OWNER_FILE = "userns-owner"  # as userns_owner.c reads it
_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC")
_NS_GET_OWNER_UID = 0xB704  # ioctl on a user namespace's fd (linux/nsfs.h)


#: Where the library is built for every home of the machine (criu processes started ahead
#: of their work name it, and outlive nothing of a home); a home's helpers folder if not writable
SHARED_DIR = INSTALL_DIR / "helpers"


def library(cfg: Config) -> Path:
    """The preloaded library (built on first use)."""
    try:
        return build(SHARED_DIR)
    except OSError:
        return build(cfg.paths.helpers)


def build(cache_dir: Path) -> Path:
    """The preloaded library, compiled into ``cache_dir`` the first time."""
    return cbuild.build(__package__, "userns_owner.c", cache_dir, "userns-owner.so", _CFLAGS, libs=("-ldl",), mode=0o755,
                        what="the restore's user namespace helper")


def write(folder: Path, uid: int) -> None:
    """Name ``uid`` as the owner of the user namespace a criu working in ``folder`` makes."""
    (folder / OWNER_FILE).write_text(f"{uid}\n")


def owner_of(pid: int) -> int:
    """The host uid owning the user namespace of process ``pid``."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, _NS_GET_OWNER_UID, buf)
        return int(struct.unpack("I", buf)[0])
    finally:
        os.close(fd)
