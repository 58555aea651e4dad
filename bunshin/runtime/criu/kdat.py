"""CRIU's kernel-feature cache (``/run/criu.kdat``), kept valid where CRIU cannot keep it.

Every criu run first probes the kernel (pagemap, netns links, nftables, ptrace,
breakpoints ...: ~20 ms here, half of a clone's restore) unless it can load
``/run/criu.kdat``, the raw ``struct kerndat_s`` of an earlier run. CRIU writes that
file only where ``/run`` is a tmpfs, so that a reboot (a new kernel) drops it; on
hosts whose ``/run`` is an ordinary folder (these VMs: ext4) it never writes it and
every run probes again. Loading checks only the file's size and two magics of the
binary that wrote it, not where it lies.

So bunshin writes it here itself: ``criu check`` in a mount namespace of its own with
a tmpfs on ``/run`` (where CRIU saves the cache as usual), the file copied out to the
host's ``/run/criu.kdat``, and next to it ``/run/criu.kdat.bunshin``: the boot, the
criu binary and the file's digest it was made for. A file made in another boot, by
another binary, or changed since, is made again. Where ``/run`` is a tmpfs, CRIU
keeps its own cache and nothing is done. Measured: restore of a clone 50 -> 20 ms.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from ..kernel import mountinfo
from ..kernel import syscalls as sc

RUN = Path("/run")
CRIU_KDAT = RUN / "criu.kdat"  # where CRIU (built with KDAT_RUNDIR=/run) reads and saves it
KDAT = CRIU_KDAT  # where bunshin installs it
STAMP = RUN / "criu.kdat.bunshin"
MAKE_TIMEOUT_S = 60.0
_MAX_BYTES = 1 << 20  # a kerndat_s is ~1 KiB


@dataclass(frozen=True)
class KdatStatus:
    """What ``status`` found: whether criu loads a cache, and why (not)."""

    cached: bool
    managed_by: str  # "criu" (a tmpfs /run), "bunshin" (made here), "none"
    detail: str


_checked: tuple[int, int, int] | None = None  # (ino, mtime_ns, size) of the file seen valid
_lock = threading.Lock()  # restores run criu from several threads


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _binary_id(criu: Path) -> str:
    """The criu that writes the cache: its wrapper and the binary it runs, by path,
    size and mtime (a reinstall makes another cache)."""
    parts = []
    for p in (criu, criu.parent.parent / "root" / "usr" / "sbin" / "criu"):
        with contextlib.suppress(OSError):
            st = os.stat(p)
            parts.append(f"{os.path.realpath(p)}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


@functools.cache
def run_is_tmpfs() -> bool:
    """Is /run a tmpfs (asked once per process: mountinfo grows with every clone)?"""
    return mountinfo.fs_type_of(RUN) == "tmpfs"


def _stamp_for(criu: Path, data: bytes) -> dict[str, str]:
    return {"boot_id": _boot_id(), "criu": _binary_id(criu), "sha256": hashlib.sha256(data).hexdigest()}


def _valid(criu: Path) -> bool:
    try:
        data = KDAT.read_bytes()
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return False
    return bool(data) and stamp == _stamp_for(criu, data)


def _enter_private_run() -> None:
    """In the child, before exec: a mount namespace of its own with a tmpfs on /run."""
    sc.unshare(sc.CLONE_NEWNS)
    sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
    sc.mount("bunshin-kdat", str(RUN), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, "mode=0755,size=1m")


def make(criu: Path) -> bytes:
    """Run ``criu check`` where it can save its cache; return the cache's bytes (b"" if
    it wrote none)."""
    script = f'"$0" check >/dev/null 2>&1; cat {CRIU_KDAT} 2>/dev/null'
    try:
        proc = subprocess.run(["/bin/sh", "-c", script, str(criu)], stdin=subprocess.DEVNULL,
                              capture_output=True, close_fds=True, timeout=MAKE_TIMEOUT_S, check=False,
                              preexec_fn=_enter_private_run)  # noqa: PLW1509 (syscalls only)
    except (OSError, subprocess.SubprocessError):
        return b""
    return proc.stdout if 0 < len(proc.stdout) <= _MAX_BYTES else b""


def _install(criu: Path, data: bytes) -> None:
    """Write the cache and its stamp (each by a temporary file and a rename)."""
    for path, content in ((KDAT, data), (STAMP, json.dumps(_stamp_for(criu, data)).encode())):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, content)
        finally:
            os.close(fd)
        os.replace(tmp, path)


def ensure(criu: Path) -> bool:
    """Make sure the next criu run loads a valid cache; True if it will.

    Cheap when nothing changed (one ``stat``): called before every criu run. Never
    raises: without a cache criu only probes the kernel again.
    """
    try:
        st = os.stat(KDAT)
        seen: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        seen = None
    if seen is not None and seen == _checked:
        return True
    if run_is_tmpfs() or os.geteuid() != 0:
        return False  # CRIU keeps its own cache there (or cannot, unprivileged)
    with _lock:
        return _ensure_locked(criu, seen)


def _ensure_locked(criu: Path, seen: tuple[int, int, int] | None) -> bool:
    global _checked
    if seen is not None and _valid(criu):
        _checked = seen
        return True
    data = make(criu)
    if not data:
        return False
    try:
        _install(criu, data)
        st = os.stat(KDAT)
    except OSError:
        return False
    _checked = (st.st_ino, st.st_mtime_ns, st.st_size)
    return True


def status(criu: Path) -> KdatStatus:
    """For ``bunshin doctor``: does criu load a cache, who keeps it."""
    if run_is_tmpfs():
        return KdatStatus(True, "criu", f"{RUN} is a tmpfs: CRIU keeps {KDAT} itself")
    if _valid(criu):
        return KdatStatus(True, "bunshin", f"{RUN} is not a tmpfs; {KDAT} made by bunshin for this boot and criu")
    return KdatStatus(False, "none", f"{RUN} is not a tmpfs, so CRIU keeps no {KDAT}: every criu run probes the "
                      "kernel again (~20 ms); bunshin makes it on its first criu run")
