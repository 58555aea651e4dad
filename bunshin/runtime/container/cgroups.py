"""Workspace cgroups, v1 or v2, always created beneath the calling process's own cgroup.

On v1 a workspace gets one folder per hierarchy (memory, pids, freezer, cpu); on v2 one
folder in the unified hierarchy. Folders are named ``<prefix><workspace id>`` so that
``gc`` can find the ones nothing owns.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from ...errors import HostUnsupported, InvalidArgument, RuntimeFailure
from ..kernel import mountinfo

if TYPE_CHECKING:
    from ..state.records import WorkspaceRecord

# cpuacct: the CPU time a workspace used (``cpu_seconds``), where v1 mounts it apart from cpu.
V1_CONTROLLERS = ("memory", "pids", "freezer", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")


@dataclass(frozen=True)
class Hierarchy:
    """One mounted hierarchy and the calling process's cgroup in it."""

    controllers: tuple[str, ...]
    mountpoint: Path
    own: Path  # path of our own cgroup, relative to the mountpoint, starting with '/'

    @functools.cached_property
    def base(self) -> Path:
        return self.mountpoint / self.own.relative_to("/")


@dataclass(frozen=True)
class Layout:
    """Where workspace cgroups go on this host."""

    version: int
    hierarchies: tuple[Hierarchy, ...]

    @classmethod
    def discover(cls) -> Layout:
        """This process's layout, read once and kept (a restore asks each time: parsing
        mountinfo cost ~1 ms of each). Read again when what it was read from changed:
        ``/proc/self/cgroup`` (the process was moved) or the filesystem a hierarchy's mount
        point holds (its ``st_dev``: unmounted, or another mounted over it)."""
        global _discovered
        with open("/proc/self/cgroup", "rb") as f:  # 4x faster than Path.read_text
            own = f.read()
        found = _discovered
        if found is not None and found[0] == own and found[1] == _devices(found[2]):
            return found[2]
        layout = cls._read(own.decode())
        _discovered = (own, _devices(layout), layout)
        return layout

    @classmethod
    def _read(cls, own_text: str) -> Layout:
        """Read /proc/self/cgroup (``own_text``) and mountinfo; prefer v1 when it holds the memory controller."""
        own: dict[str, str] = {}
        for line in own_text.splitlines():
            _, ctrls, path = line.split(":", 2)
            own[ctrls] = path
        mounts = _cgroup_mounts()
        v1 = []
        for ctrls, path in own.items():
            names = tuple(c for c in ctrls.split(",") if c)
            if not names or not any(c in V1_CONTROLLERS for c in names):
                continue
            mp = mounts.get(("cgroup", frozenset(names)))
            if mp is not None:
                v1.append(Hierarchy(names, mp, Path(path)))
        if any("memory" in h.controllers for h in v1):
            return cls(1, tuple(v1))
        mp = mounts.get(("cgroup2", frozenset()))
        if mp is not None and "" in own:
            return cls(2, (Hierarchy(V2_CONTROLLERS, mp, Path(own[""])),))
        raise HostUnsupported(
            "no usable cgroup hierarchy with a memory controller",
            hint="mount cgroup v1 controllers (memory, pids) or a cgroup2 with memory and pids enabled",
        )

    def find(self, prefix: str) -> list[Path]:
        """Every workspace cgroup folder (named ``prefix*``) anywhere in our hierarchies.

        The whole tree is searched, not only beneath our own cgroup: the caller's own
        cgroup may differ between invocations (as the memory cgroup does here).
        """
        out: list[Path] = []
        for h in self.hierarchies:
            for dirpath, dirnames, _ in os.walk(h.mountpoint):
                for d in list(dirnames):
                    if d.startswith(prefix):
                        out.append(Path(dirpath) / d)
                        dirnames.remove(d)
        return sorted(set(out))


#: The layout ``Layout.discover`` read last: the /proc/self/cgroup text and the mount
#: points' devices it was read with.
_discovered: tuple[bytes, tuple[int | None, ...], Layout] | None = None


def _devices(layout: Layout) -> tuple[int | None, ...]:
    """The device of each hierarchy's mount point now (None: not there)."""
    out: list[int | None] = []
    for h in layout.hierarchies:
        try:
            out.append(os.stat(h.mountpoint).st_dev)
        except OSError:
            out.append(None)
    return tuple(out)


def _cgroup_mounts() -> dict[tuple[str, frozenset[str]], Path]:
    found: dict[tuple[str, frozenset[str]], Path] = {}
    for m in mountinfo.read():
        fstype, mp = m.fs_type, Path(m.mount_point)
        if fstype == "cgroup":
            names = frozenset(o for o in m.super_options.split(",") if o in V1_CONTROLLERS or o.startswith("name=") or o in ("cpuacct", "cpuset", "devices", "blkio", "net_cls", "net_prio", "perf_event", "hugetlb", "rdma", "misc"))
            found.setdefault((fstype, names), mp)
        elif fstype == "cgroup2":
            found.setdefault((fstype, frozenset()), mp)
    return found


#: Smallest memory limit a workspace may get: its agent alone needs ~9 MiB (anonymous
#: memory, page tables, kernel memory), a shell and a command a few MiB more.
MIN_MEMORY = 32 << 20


def parse_size(text: str | int | None) -> int | None:
    """A workspace memory limit: '2G', '512M', '1048576' -> bytes. None stays None.

    Refused: below :data:`MIN_MEMORY`, and above the host's memory (MemTotal): a
    limit the host cannot give is no limit.
    """
    if text is None:
        return None
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise InvalidArgument(f"malformed size {text!r}", hint="use a number with an optional unit, e.g. 512M or 2G")
    if isinstance(text, int):
        value = text
    else:
        units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
        t = text.strip().lower().removesuffix("b").removesuffix("i")
        num, unit = (t[:-1], t[-1]) if t and t[-1] in units and not t[-1].isdigit() else (t, "")
        try:
            number = float(num)
        except ValueError:
            raise InvalidArgument(
                f"malformed size {text!r}", hint="use a number with an optional unit, e.g. 512M or 2G"
            ) from None
        if not math.isfinite(number):
            raise InvalidArgument(f"malformed size {text!r}", hint="use a finite number, e.g. 512M or 2G")
        value = int(number * units[unit])
    if value <= 0:
        raise InvalidArgument(f"size must be positive, got {text!r}")
    check_memory_limit(value, text)
    return value


def check_memory_limit(value: int, text: str | int | None = None) -> None:
    """Refuse a memory limit below :data:`MIN_MEMORY` or above the host's memory."""
    shown = text if text is not None else value
    if value < MIN_MEMORY:
        raise InvalidArgument(
            f"memory limit {shown!r} ({_mib(value)}) is too small for a workspace",
            hint=f"give at least {MIN_MEMORY >> 20}M: the workspace's agent alone needs ~9 MiB",
        )
    total = psutil.virtual_memory().total
    if value > total:
        raise InvalidArgument(
            f"memory limit {shown!r} ({_mib(value)}) is more than this host's {_mib(total)} of memory",
            hint=f"give at most {total >> 20}M",
        )


def _mib(n: int) -> str:
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n / (1 << 20):.4g} MiB" if n < 1 << 30 else f"{n / (1 << 30):.4g} GiB"


@dataclass(frozen=True)
class WorkspaceCgroup:
    """The cgroup folders of one workspace: ``dirs`` maps a controller to its folder."""

    version: int
    dirs: tuple[tuple[str, Path], ...]

    def dirs_as_str(self) -> tuple[tuple[str, str], ...]:
        return tuple((c, str(p)) for c, p in self.dirs)

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys(p for _, p in self.dirs))

    @classmethod
    def of_record(cls, rec: WorkspaceRecord) -> WorkspaceCgroup:
        """The folders a workspace record names."""
        return cls(rec.cgroup_version, tuple((c, Path(p)) for c, p in rec.cgroups))

    @classmethod
    def of(cls, layout: Layout, name: str) -> WorkspaceCgroup:
        """The (possibly not yet existing) folders named ``name``."""
        dirs = []
        for h in layout.hierarchies:
            for c in h.controllers:
                if c in V1_CONTROLLERS or layout.version == 2:
                    dirs.append((c, h.base / name))
        return cls(layout.version, tuple(dirs))

    @classmethod
    def create(cls, layout: Layout, name: str, *, memory: int | None, pids: int | None) -> WorkspaceCgroup:
        cg = cls.of(layout, name)
        try:
            if layout.version == 2:
                _enable_v2_controllers(layout.hierarchies[0].base)
            for p in cg.paths:
                p.mkdir()
            cg.set_limits(memory=memory, pids=pids)
            return cg
        except OSError as e:
            cg.destroy()
            raise RuntimeFailure(f"cannot create cgroup {name}: {e}") from e
        except Exception:
            cg.destroy()
            raise

    def _file(self, controller: str, name: str) -> Path | None:
        for c, p in self.dirs:
            if c == controller and (p / name).exists():
                return p / name
        return None

    def set_limits(self, *, memory: int | None, pids: int | None) -> None:
        if memory is not None:
            if self.version == 1:
                _write(self._need("memory", "memory.limit_in_bytes"), str(memory))
                swap = self._file("memory", "memory.memsw.limit_in_bytes")
                if swap is not None:
                    _write(swap, str(memory))
            else:
                _write(self._need("memory", "memory.max"), str(memory))
                swap = self._file("memory", "memory.swap.max")
                if swap is not None:
                    _write(swap, "0")
        if pids is not None:
            _write(self._need("pids", "pids.max"), str(pids))

    def _need(self, controller: str, name: str) -> Path:
        f = self._file(controller, name)
        if f is None:
            raise HostUnsupported(f"cgroup controller {controller!r} is not available ({name} missing)")
        return f

    def pids(self) -> list[int]:
        out: set[int] = set()
        for p in self.paths:
            try:
                out.update(int(x) for x in (p / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def set_cpu_nice(self, nice: int) -> None:
        """Weigh the whole cgroup's CPU share as the scheduler weighs a nice value
        (0: the default, 19: ~1.5 % of it when competing): the host's to set, since
        nothing inside a user namespace may lower a nice value again."""
        if not 0 <= nice <= 19:
            raise InvalidArgument(f"nice {nice} is out of range", hint="give 0..19")
        weight = 1024 / 1.25**nice  # sched_prio_to_weight: x1.25 per step
        if self.version == 1:
            _write(self._need("cpu", "cpu.shares"), str(max(int(weight), 2)))
        else:
            _write(self._need("cpu", "cpu.weight"), str(max(int(weight * 100 / 1024), 1)))

    def memory_bytes(self) -> int:
        f = self._file("memory", "memory.usage_in_bytes" if self.version == 1 else "memory.current")
        return int(f.read_text()) if f else 0

    def cpu_seconds(self) -> float:
        """CPU time (user and system) used by every process that ran in the cgroup, the
        exited ones included: v2's ``cpu.stat`` ``usage_usec``, v1's ``cpuacct.usage``
        (nanoseconds). 0.0 where the host keeps no count (no cpuacct hierarchy)."""
        if self.version == 1:
            f = self._file("cpuacct", "cpuacct.usage")
            return int(f.read_text()) / 1e9 if f else 0.0
        f = self._file("cpu", "cpu.stat")
        for line in f.read_text().splitlines() if f else ():
            k, _, v = line.partition(" ")
            if k == "usage_usec":
                return int(v) / 1e6
        return 0.0

    def kill_all(self, timeout: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until it is empty."""
        deadline = time.monotonic() + timeout
        pause = 0.0005  # killed tasks exit in well under a ms: a fixed 10 ms wait was most of a removal
        while True:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"processes {pids} survive SIGKILL in {self.paths[0]}")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def destroy(self) -> None:
        """Kill what is left and remove the folders (idempotent)."""
        for p in self.paths:
            if not p.exists():
                continue
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    for pid in _read_pids(p):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    p.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if time.monotonic() > deadline:
                        raise RuntimeFailure(f"cannot remove cgroup {p}: {e}") from e
                    time.sleep(0.01)


def _enable_v2_controllers(base: Path) -> None:
    wanted = [c for c in ("memory", "pids") if c in (base / "cgroup.controllers").read_text().split()]
    enabled = (base / "cgroup.subtree_control").read_text().split()
    missing = [c for c in wanted if c not in enabled]
    if missing:
        try:
            (base / "cgroup.subtree_control").write_text(" ".join("+" + c for c in missing))
        except OSError as e:
            raise HostUnsupported(
                f"cannot enable {missing} for child cgroups of {base}: {e.strerror}",
                hint="run bunshin from a cgroup without other processes (cgroup v2 'no internal processes' rule)",
            ) from e


def _read_pids(p: Path) -> list[int]:
    try:
        return [int(x) for x in (p / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise RuntimeFailure(f"cannot write {value!r} to {path}: {e.strerror}") from e
