"""A ``syscall`` instruction (``0f 05``) the live process already maps executable: where injected calls run.

The vDSO first (the kernel's own text, a few pages, the same bytes in every
process), then the process's file-backed executable mappings. The bytes are
read through ``/proc/PID/mem`` (the kernel's view, never a path the process
names).
"""

from __future__ import annotations

import os
from pathlib import Path

_SCAN_LIMIT = 64 << 20


class NoSite(Exception):
    """The process maps no readable ``syscall`` instruction."""


def _exec_areas(pid: int, proc: Path) -> list[tuple[int, int, str]]:
    out = []
    for line in (proc / str(pid) / "maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or "x" not in parts[1]:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    out.sort(key=lambda a: (a[2] != "[vdso]", a[2] == "", a[0]))  # vdso, then files, then anonymous
    return out


def syscall_site(pid: int, proc: Path = Path("/proc")) -> int:
    """The address of a ``0f 05`` in executable memory of ``pid`` (stopped: its maps cannot change)."""
    fd = os.open(proc / str(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)
    scanned = 0
    try:
        for lo, hi, name in _exec_areas(pid, proc):
            if name in ("[vsyscall]",):
                continue
            pos = lo
            while pos < hi and scanned < _SCAN_LIMIT:
                n = min(1 << 20, hi - pos)
                try:
                    data = os.pread(fd, n + (1 if pos + n < hi else 0), pos)
                except OSError:
                    break
                scanned += len(data)
                at = data.find(b"\x0f\x05")
                if at >= 0 and pos + at + 2 <= hi:
                    return pos + at
                pos += n
    finally:
        os.close(fd)
    raise NoSite(f"process {pid} maps no readable syscall instruction")
