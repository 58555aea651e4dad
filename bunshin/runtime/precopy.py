"""Live pre-copy before a copy-on-write dump (``Config.fork_precopy``, issue 17).

Each process of the workspace holding at least ``MIN_BYTES`` of plain anonymous
memory is converted live (``memfile.live``, with the trap): its areas are
copied into a memory file while it runs, it is stopped only for the pages
written meanwhile and the remap, and from then on it is like a clone: CRIU's
dump holds only what it wrote since (a delta), the rewrite finds the file and
the trap as in a clone's dump, and every later fork of it is a delta too.

Where the files lie. The process maps ``/.bunshin/mem/live-<workspace>-<hex>``
of its own upper (the workspace's tmpfs, so that it and CRIU reach it by
path); that folder and ``/.bunshin`` must be host-owned (the workspace's root
is an unprivileged host id: it can neither write them nor plant anything
there), the file is mode 0444, owned by host root. The upper is its own tmpfs,
so the clones' copy cannot be a link of it: once the process runs again the
file is copied (holes kept) to ``Config.paths.mem`` under the same name, sealed,
and each snapshot's layer links that copy (``link_names``), as the rewrite's
own files. The system holds two copies (the parent's and the clones'), as
without pre-copy (the parent's anonymous memory and the clones' file), but
the parent is stopped only for the pages written during the copy. The
frozen copy of the upper skips ``/.bunshin/mem`` (each layer gets its own anew).
A live copy in ``paths.mem`` stays while its workspace exists or a layer links
it (``sweep_keeps``). A process that cannot be converted exactly
(``LiveUnavailable``: no trap, areas that change under the copy, a full upper,
...) is left to CRIU as before, the reason recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bunshin.config import Config

from . import statefs
from . import syscalls as sc
from .memfile import SUFFIX, remove_memfile, trapcode
from .memfile.criu_images import referenced_memfiles
from .memfile.fileio import data_extents, seal, write_data
from .memfile.live import LiveUnavailable, alive_or_refuse, convert_live, live_areas_held

PREFIX = "live-"
#: a live file's name: its workspace, a random tag (snapshot_io saves and loads these with a layer)
LIVE_NAME = re.compile(r"live-(ws-[0-9a-f]{12})-[0-9a-f]{8}" + re.escape(SUFFIX))
MIN_BYTES = 16 << 20  # smaller: CRIU's copy costs less than a conversion
_SLACK = 8 << 20  # the handler, its table, a partial huge page
REPORT = "precopy.json"  # in the snapshot's folder
SHARE_THREADS = 2  # the clones' copy, side by side (two cores here)
SHARE_PIECE = 64 << 20  # a multiple of 2 MiB


@dataclass(frozen=True)
class Converted:
    pid: int
    path: str
    bytes: int
    precopy_ms: float
    pause_ms: float  # this process's longest stop: dirty copy, trap, remap of one piece
    stopped_ms: float  # all its stops (one per piece of memfile.live.CHUNK)
    stops: int
    stop_ms: float
    dirty_ms: float
    remap_ms: float
    dirty_bytes: int
    share_ms: float  # copying it for the clones, the process running
    trap_ms: float = 0.0  # of remap_ms: the trap
    map_ms: float = 0.0  # of remap_ms: the MAP_FIXED mappings


@dataclass(frozen=True)
class Skipped:
    pid: int
    reason: str


@dataclass
class Report:
    converted: list[Converted] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    wall_ms: float = 0.0

    @property
    def pause_ms(self) -> float:
        """The longest time a process of the workspace was stopped at once for it."""
        return max((c.pause_ms for c in self.converted), default=0.0)

    @property
    def bytes(self) -> int:
        """What the new live files hold (the clones map them as the rewrite's own)."""
        return sum(c.bytes for c in self.converted)

    @property
    def stopped_ms(self) -> float:
        """All the stops of all its processes together."""
        return sum(c.stopped_ms for c in self.converted)

    def save(self, folder: Path) -> None:
        (folder / REPORT).write_text(json.dumps({**asdict(self), "pause_ms": self.pause_ms,
                                                 "stopped_ms": self.stopped_ms}))


def _mem_dir(upper: Path) -> int:
    """The upper's host-owned ``/.bunshin/mem`` (made if missing), opened without following anything."""
    fd = sc.open_dir_beneath(upper, (".bunshin",))
    try:
        if os.fstat(fd).st_uid != 0:
            raise LiveUnavailable("the workspace's /.bunshin is not the host's")
        try:
            os.mkdir("mem", 0o755, dir_fd=fd)
        except FileExistsError:
            pass
        child = os.open("mem", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    st = os.fstat(child)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(child)
        raise LiveUnavailable("the workspace's /.bunshin/mem is not the host's")
    return child


def convert(cfg: Config, ws_id: str, upper: Path, root: Path, view: str, pids: list[int]) -> Report:
    """Convert each of ``pids`` (host pids of the workspace, its init first) that holds enough memory;
    what happened. Each is pinned by a pidfd and must be in the init's pid namespace (a pid
    listed may be reused by a host process before its turn).

    ``root``: the workspace's overlay on the host, where the file is looked at as
    the processes see it (through descriptors, never following a symlink).
    """
    t0 = time.perf_counter()
    report = Report()
    try:
        blob = trapcode.build_blob(cfg.paths.sigsys)
        cfg.paths.mem.mkdir(parents=True, exist_ok=True)  # (the clones' copies)
        dir_fd = _mem_dir(upper)
    except (OSError, LiveUnavailable) as exc:
        report.skipped = [Skipped(p, f"no live conversion: {exc}") for p in pids]
        return report
    try:
        pid_ns = os.readlink(f"/proc/{pids[0]}/ns/pid") if pids else ""
        for pid in pids:
            _one(cfg, ws_id, view, dir_fd, upper, root, blob, pid, pid_ns, report)
    except OSError as exc:
        report.skipped.append(Skipped(pids[0], f"the workspace's pid namespace cannot be told: {exc.strerror}"))
    finally:
        os.close(dir_fd)
    report.wall_ms = (time.perf_counter() - t0) * 1000
    return report


def _one(cfg: Config, ws_id: str, view: str, dir_fd: int, upper: Path, root: Path, blob: trapcode.Blob,
         pid: int, pid_ns: str, report: Report) -> None:
    try:
        held = live_areas_held(pid)
    except OSError as exc:
        report.skipped.append(Skipped(pid, f"its memory map cannot be read: {exc.strerror}"))
        return
    areas, size = [(a, b) for a, b, _ in held], sum(n for _, _, n in held)
    if size < MIN_BYTES:
        report.skipped.append(Skipped(pid, f"{size >> 20} MiB of anonymous memory: left to the dump"))
        return
    name = f"{PREFIX}{ws_id}-{secrets.token_hex(4)}{SUFFIX}"
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        report.skipped.append(Skipped(pid, "it exited"))
        return
    try:
        # the pid listed may be another process's by now: the one pidfd names must be in the workspace
        if os.readlink(f"/proc/{pid}/ns/pid") != pid_ns:
            raise LiveUnavailable("it is not in the workspace's pid namespace")
        alive_or_refuse(pidfd, pid)
    except (LiveUnavailable, OSError) as exc:
        os.close(pidfd)
        report.skipped.append(Skipped(pid, str(exc)))
        return
    try:
        _convert_one(cfg, name, view, dir_fd, upper, root, blob, pid, pidfd, areas, size, report)
    finally:
        os.close(pidfd)


def _convert_one(cfg: Config, name: str, view: str, dir_fd: int, upper: Path, root: Path, blob: trapcode.Blob,
                 pid: int, pidfd: int, areas: list[tuple[int, int]], size: int, report: Report) -> None:
    before = 0
    try:
        before = _make_room(upper.parent, size)
        res = convert_live(pid, areas, Path(name), f"{view.rstrip('/')}/{name}", trap=blob, immutable=False,
                           dir_fd=dir_fd, seen_as=lambda: _seen(root, view, name), pidfd=pidfd)
    except (LiveUnavailable, OSError) as exc:
        kept = _exists(dir_fd, name)  # the process maps it already (the trap, a piece): the clones need it too
        if before and not kept:  # no file took the room: the workspace gets no more
            with contextlib.suppress(OSError):
                _resize(upper.parent, before)
        if kept:
            with contextlib.suppress(OSError):
                _copy_sealed(dir_fd, name, cfg.paths.mem / name, statefs.huge_memfiles(cfg))
        report.skipped.append(Skipped(pid, str(exc)))
        return
    t0 = time.perf_counter()
    shared = cfg.paths.mem / name
    _copy_sealed(dir_fd, name, shared, statefs.huge_memfiles(cfg))
    report.converted.append(Converted(
        pid, str(shared), res.precopy_bytes + res.dirty_bytes, round(res.precopy_ms, 2), round(res.pause_ms, 2),
        round(res.stopped_ms, 2), res.stops, round(res.stop_ms, 2), round(res.dirty_ms, 2), round(res.remap_ms, 2), res.dirty_bytes,
        round((time.perf_counter() - t0) * 1000, 2), round(res.trap_ms, 2), round(res.map_ms, 2)))


def _make_room(wdir: Path, size: int) -> int:
    """Grow the workspace's upper tmpfs (if it has a size) by what the live file will hold; its size before.

    The file takes that room for good: the workspace keeps the free space it had.
    """
    st = os.statvfs(wdir)
    total = st.f_blocks * st.f_frsize
    if total:
        _resize(wdir, total + size + _SLACK)
    return total


def _resize(wdir: Path, size: int) -> None:
    sc.mount("bunshin-upper", str(wdir), "tmpfs", sc.MS_REMOUNT | sc.MS_NOSUID | sc.MS_NODEV, f"size={size}")


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _seen(root: Path, view: str, name: str) -> os.stat_result:
    fd = sc.open_dir_beneath(root, Path(view).relative_to("/").parts, path_only=True)
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)


def _copy_sealed(dir_fd: int, name: str, dst: Path, huge: bool) -> None:
    """The clones' copy of a live file (it no longer changes: sealed, mapped), holes kept, sealed."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        out = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(src).st_size
            os.ftruncate(out, size)
            pieces = [p for off, length in data_extents(src, 0, size) for p in _cut(off, off + length)]
            with ThreadPoolExecutor(SHARE_THREADS) as pool:  # dense 2 MiB regions as huge pages, as the rewrite
                list(pool.map(lambda p: write_data(src, p[0], out, p[0], p[1] - p[0], huge=huge), pieces))
            seal(out)
        except BaseException:
            os.close(out)
            remove_memfile(dst)
            raise
        os.close(out)
    finally:
        os.close(src)


def _cut(start: int, end: int) -> list[tuple[int, int]]:
    """``[start, end)`` in pieces of ``SHARE_PIECE`` bytes cut at 2 MiB boundaries (huge pages stay whole)."""
    out, lo = [], start
    while lo < end:
        hi = min(end, (lo // SHARE_PIECE + 1) * SHARE_PIECE)
        out.append((lo, hi))
        lo = hi
    return out


def link_names(cfg: Config, images: Path, view: str) -> list[str]:
    """Host paths of the live memory files a dump maps (its layer must link them too)."""
    prefix = view.rstrip("/") + "/" + PREFIX
    out = []
    for name in sorted(referenced_memfiles(images)):
        if name.startswith(prefix) and "/" not in name[len(prefix):]:
            path = cfg.paths.mem / name[len(view.rstrip("/")) + 1:]
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode):
                    out.append(str(path))
    return out


def sweep_keeps(path: Path, workspaces: set[str]) -> bool:
    """Whether the sweep keeps a live memory file: its workspace exists, or a layer links it."""
    if not path.name.startswith(PREFIX):
        return False
    if path.name.removesuffix(SUFFIX).removeprefix(PREFIX).rsplit("-", 1)[0] in workspaces:
        return True
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink > 1
