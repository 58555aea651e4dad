"""Cheap moves into cgroups: the host's cgroup2 mounted with ``favordynmods``.

A restore's criu joins the clone's cgroups (``criu.Placement.cgroup_procs``): each
move takes the kernel's one ``cgroup_threadgroup_rwsem`` for writing, which in its
default mode first waits for an RCU grace period. Measured here, a restore's first
move took 3.5-17 ms on a busy machine (p50 of criu's whole placement 5.6 ms); with
``favordynmods`` 0.03 ms (placement p50 0.9 ms). The option (Linux >= 6.0) keeps
that semaphore in the mode where writers are cheap, for every hierarchy at once, at
some cost to forks and exits, which then take it as a plain rwsem.

``ensure`` turns it on before a batch of restores, by reconfiguring the host's cgroup2
mount (``fspick``: its other options are given again, the mount's own flags are not
touched); ``BUNSHIN_CGROUP_FAVOR_DYNMODS=0`` leaves the host as it is. ``bunshin
doctor`` shows it ("cgroup moves").
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

from ..kernel import mountinfo
from ..kernel import syscalls as sc

OPTION = "favordynmods"
ENV = "BUNSHIN_CGROUP_FAVOR_DYNMODS"
# cgroup2's own flags: a reconfigure sets exactly the flags it is given
KEPT_FLAGS = ("nsdelegate", "memory_localevents", "memory_recursiveprot", "memory_hugetlb_accounting",
              "pids_localevents")
_SYS_FSCONFIG, _SYS_FSPICK = 431, 433  # x86_64
_FSPICK_CLOEXEC = 0x1
_FSCONFIG_SET_FLAG, _FSCONFIG_CMD_RECONFIGURE = 0, 7

_result: bool | None = None  # what ``ensure`` found or did, once per process
_lock = threading.Lock()


@dataclass(frozen=True)
class Status:
    """The host's cgroup2 mount and whether moves into cgroups are cheap."""

    mount_point: str | None  # None: no cgroup2 mounted
    favored: bool
    flags: tuple[str, ...]  # its cgroup2 flags, ``OPTION`` included when on


def status() -> Status:
    for entry in mountinfo.read():
        if entry.fs_type == "cgroup2":
            flags = tuple(o for o in entry.super_options.split(",") if o in (*KEPT_FLAGS, OPTION))
            return Status(entry.mount_point, OPTION in flags, flags)
    return Status(None, False, ())


def reconfigure(st: Status, flags: tuple[str, ...]) -> None:
    """Reconfigure ``st``'s mount with exactly these cgroup2 ``flags``."""
    assert st.mount_point is not None
    fd = sc.syscall(_SYS_FSPICK, ctypes.c_int(-100), st.mount_point.encode(), ctypes.c_uint(_FSPICK_CLOEXEC))
    try:
        for flag in dict.fromkeys(flags):
            sc.syscall(_SYS_FSCONFIG, ctypes.c_int(fd), ctypes.c_uint(_FSCONFIG_SET_FLAG), flag.encode(), None,
                       ctypes.c_int(0))
        sc.syscall(_SYS_FSCONFIG, ctypes.c_int(fd), ctypes.c_uint(_FSCONFIG_CMD_RECONFIGURE), None, None,
                   ctypes.c_int(0))
    finally:
        os.close(fd)


def ensure() -> bool:
    """Turn ``favordynmods`` on, keeping the mount's other flags (unless ``ENV`` is 0);
    whether it is on. Looked at once per process (mountinfo grows with the clones)."""
    global _result
    with _lock:
        if _result is None:
            st = status()
            if not st.favored and st.mount_point is not None and os.environ.get(ENV) != "0":
                try:
                    reconfigure(st, (*st.flags, OPTION))
                except OSError:
                    pass  # a kernel without the option: moves stay as they were
                st = status()
            _result = st.favored
        return _result
