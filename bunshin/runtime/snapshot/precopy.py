"""Live pre-copy before a copy-on-write dump (``Config.fork_precopy``, issue 17).

Each process of the workspace holding at least ``MIN_BYTES`` of plain anonymous
memory is converted live (``memfile.live``, with the trap): its areas are
copied into a memory file while it runs, it is stopped only for the pages
written meanwhile and the remap, and from then on it is like a clone: CRIU's
dump holds only what it wrote since (a delta), the rewrite finds the file and
the trap as in a clone's dump, and every later fork of it is a delta too.

Where the file lies: one copy. It is written in ``Config.paths.mem`` as
``live-<workspace>-<hex>`` (host root's, sealed once converted), where each
snapshot's layer links it (``link_names``) for the clones, as the rewrite's own
files. The process reaches it at ``/.bunshin/mem/<name>`` (what its mappings
and its trap's table name) through a read-only bind of that very file over an
empty placeholder the host makes in the host-owned ``/.bunshin/mem``, through the
workspace's merged root (``memfile.live_bind``). A dump of the process names the bind external
(``dump_externals``) and ``drop_binds`` then takes the bind out of the images:
the file is named from the workspace's root mount, where each clone's layer
holds its link. The frozen copy of the upper skips ``/.bunshin/mem`` (each layer
gets its own anew). A live file stays while its workspace exists or a layer
links it (``sweep_keeps``). A process that cannot be converted exactly
(``LiveUnavailable``: no trap, areas that change under the copy, ...) is left
to CRIU as before, the reason recorded. The host's threads doing it weigh
``fork_boost.factor()`` times the default CPU weight meanwhile (``fork_boost``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bunshin.config import Config
from bunshin.errors import BunshinError, InvalidArgument

from ..criu import fork_boost
from ..kernel import syscalls as sc
from ..memfile import SUFFIX, criu_images, live_bind, trapcode
from ..memfile.criu_images import referenced_memfiles
from ..memfile.fileio import seal
from ..memfile.live import LiveUnavailable, alive_or_refuse, convert_live, live_areas_held

PREFIX = "live-"
#: a live file's name: its workspace, a random tag (folder_save and folder_load carry these with a layer)
LIVE_NAME = re.compile(r"live-(ws-[0-9a-f]{12})-[0-9a-f]{8}" + re.escape(SUFFIX))
MIN_BYTES = 16 << 20  # smaller: CRIU's copy costs less than a conversion
REPORT = "precopy.json"  # in the snapshot's folder
BIND_KEY = "bunshin-live-"  # CRIU's key of a live file's bind (``dump_externals``)


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
    share_ms: float  # (none since the one copy: kept for older reports)
    trap_ms: float = 0.0  # of remap_ms: the trap
    map_ms: float = 0.0  # of remap_ms: the MAP_FIXED mappings
    publish_ms: float = 0.0  # binding the file into its mount namespace (running)
    rounds: list[int] = field(default_factory=list)  # bytes written meanwhile, per later pre-copy pass
    pass_ms: list[float] = field(default_factory=list)  # each pre-copy pass (the first copies everything)
    cut_short: str = ""  # why its later pieces were left to the dump (e.g. the tmpfs was full)


@dataclass(frozen=True)
class Skipped:
    pid: int
    reason: str


@dataclass
class Report:
    converted: list[Converted] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    wall_ms: float = 0.0
    cpu_boost: int = 1  # the host's threads' CPU weight meanwhile, times the default (``fork_boost``)

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


def _mem_dir(root: Path) -> int:
    """The host-owned ``/.bunshin/mem`` of the workspace's merged root (made if missing),
    opened without following anything. Through the overlay, not in its upper: a clone's
    folder is its snapshot layer's, and a file made behind the overlay's back is never seen."""
    fd = sc.open_dir_beneath(root, (".bunshin",))
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


def convert(cfg: Config, ws_id: str, root: Path, view: str, pids: list[int]) -> Report:
    """Convert each of ``pids`` (host pids of the workspace, its init first) that holds enough memory;
    what happened. Each is pinned by a pidfd and must be in the init's pid namespace (a pid
    listed may be reused by a host process before its turn).

    ``root``: the workspace's merged root (its ``/.bunshin/mem`` holds the placeholders).
    """
    min_bytes(cfg)  # bad settings refused before anything is done
    by = fork_boost.factor()
    t0 = time.perf_counter()
    report = Report()
    try:
        blob = trapcode.build_blob(cfg.paths.sigsys)
        cfg.paths.mem.mkdir(parents=True, exist_ok=True)  # (the live files)
        dir_fd = _mem_dir(root)
    except (OSError, LiveUnavailable) as exc:
        report.skipped = [Skipped(p, f"no live conversion: {exc}") for p in pids]
        return report
    try:
        pid_ns = os.readlink(f"/proc/{pids[0]}/ns/pid") if pids else ""
        with fork_boost.boosted(by) as boost:  # the copies, stops and remaps first (bounded)
            report.cpu_boost = by if boost is not None else 1
            for pid in pids:
                _one(cfg, ws_id, view, dir_fd, blob, pid, pid_ns, report)
    except OSError as exc:
        report.skipped.append(Skipped(pids[0], f"the workspace's pid namespace cannot be told: {exc.strerror}"))
    finally:
        os.close(dir_fd)
    report.wall_ms = (time.perf_counter() - t0) * 1000
    return report


def wanted(cfg: Config, pids: list[int]) -> bool:
    """Whether any of ``pids`` may hold enough anonymous memory to be pre-copied: its
    ``RssAnon`` and ``VmSwap`` (two lines of /proc/PID/status, not the smaps ``convert``
    reads), so a workspace of small processes, or a clone whose memory is its memory
    files', forks as before at no cost."""
    least = min_bytes(cfg)
    return any(anon_bytes(pid) >= least for pid in pids)


def anon_bytes(pid: int) -> int:
    """The anonymous memory ``pid`` holds, resident or swapped (``RssAnon`` + ``VmSwap`` of
    /proc/PID/status: counters, not a walk of its page tables); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
    except OSError:
        return 0
    return sum(int(fields.get(k, b"0 kB").split()[0]) for k in (b"RssAnon", b"VmSwap")) << 10


def min_bytes(cfg: Config) -> int:
    """The anonymous memory a process must hold to be pre-copied (``Config.fork_precopy_min_mib``)."""
    least = cfg.fork_precopy_min_mib
    if not isinstance(least, int) or least < 0:
        raise InvalidArgument(f"fork_precopy_min_mib={least!r} is not a whole number of MiB",
                              field="fork_precopy_min_mib", hint="e.g. BUNSHIN_FORK_PRECOPY_MIN_MIB=1024")
    return max(MIN_BYTES, least << 20)


def _one(cfg: Config, ws_id: str, view: str, dir_fd: int, blob: trapcode.Blob, pid: int, pid_ns: str,
         report: Report) -> None:
    try:
        held = live_areas_held(pid)
    except OSError as exc:
        report.skipped.append(Skipped(pid, f"its memory map cannot be read: {exc.strerror}"))
        return
    areas, size = [(a, b) for a, b, _ in held], sum(n for _, _, n in held)
    if size < min_bytes(cfg):
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
        _convert_one(cfg, name, view, dir_fd, blob, pid, pidfd, areas, report)
    finally:
        os.close(pidfd)


def _convert_one(cfg: Config, name: str, view: str, dir_fd: int, blob: trapcode.Blob, pid: int, pidfd: int,
                 areas: list[tuple[int, int]], report: Report) -> None:
    """The file is written in ``paths.mem`` and bound over a placeholder in ``dir_fd`` (``live_bind``)."""
    host = os.open(cfg.paths.mem, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    bound = []

    def publish() -> None:  # the process still running, the file host root's 0600
        live_bind.bind(host, name, pidfd, view)
        bound.append(name)

    try:
        _placeholder(dir_fd, name)
        try:
            res = convert_live(pid, areas, Path(name), f"{view.rstrip('/')}/{name}", trap=blob, immutable=True,
                               dir_fd=host, pidfd=pidfd, publish=publish)
        except (LiveUnavailable, OSError) as exc:
            if _exists(host, name):  # the process maps it already (the trap, a piece): the clones need it too
                with contextlib.suppress(OSError):
                    _seal_at(host, name)
            else:
                if bound:
                    with contextlib.suppress(OSError):
                        live_bind.unbind(pidfd, view, name)
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
            report.skipped.append(Skipped(pid, str(exc)))
            return
    finally:
        os.close(host)
    report.converted.append(Converted(
        pid, str(cfg.paths.mem / name), res.precopy_bytes + res.dirty_bytes, round(res.precopy_ms, 2),
        round(res.pause_ms, 2), round(res.stopped_ms, 2), res.stops, round(res.stop_ms, 2), round(res.dirty_ms, 2),
        round(res.remap_ms, 2), res.dirty_bytes, 0.0, round(res.trap_ms, 2), round(res.map_ms, 2),
        round(res.publish_ms, 2), list(res.rounds), [round(t, 2) for t in res.pass_ms], res.cut_short))


def _placeholder(dir_fd: int, name: str) -> None:
    """The empty host-owned file the bind covers (the path the process's mappings name)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o444)
    finally:
        os.close(fd)


def _seal_at(dir_fd: int, name: str) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        seal(fd)
    finally:
        os.close(fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


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


def bound_views(pid: int, view: str) -> list[str]:
    """The live files bound in ``pid``'s mount namespace (``live_bind``), as its mount points name them.

    Only the host mounts there (the workspace's filter refuses every mount call),
    and only names of ``LIVE_NAME`` under ``view`` are taken.
    """
    out = []
    prefix = view.rstrip("/") + "/"
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4].startswith(prefix) and LIVE_NAME.fullmatch(fields[4][len(prefix):]):
            out.append(fields[4])
    return sorted(set(out))


def dump_externals(pid: int | None, view: str) -> list[str]:
    """CRIU's ``--external`` arguments for the live files bound in the workspace of init ``pid``."""
    if pid is None:
        return []
    out: list[str] = []
    for point in bound_views(pid, view):
        out += ["--external", f"mnt[{point}]:{BIND_KEY}{Path(point).name.removesuffix(SUFFIX)}"]
    return out


def drop_binds(images: Path) -> int:
    """Take the live files' binds (``dump_externals``) out of a dump: every file opened or mapped
    through one is named from its namespace's root mount instead (where each clone's layer links
    the file, by the same path). How many binds were dropped."""
    files_path = images / "files.img"
    moved: dict[int, int] = {}  # a bind's mnt_id -> its namespace's root mount's
    for path in sorted(images.glob("mountpoints-*.img")):
        img = criu_images.load(path)
        entries = img["entries"]
        binds = [e for e in entries if str(e.get("ext_key", "")).startswith(BIND_KEY)]
        if not binds:
            continue
        roots = [e for e in entries if e.get("mountpoint") == "/"]
        if len(roots) != 1:
            raise BunshinError(f"the dump's {path.name} has no one root mount to name the live files from",
                               hint="fork again; if it persists, report the dump log")
        for b in binds:
            if any(e.get("parent_mnt_id") == b["mnt_id"] for e in entries):
                raise BunshinError(f"a mount was made over the live file {b.get('mountpoint')}",
                                   hint="the workspace's mounts were changed: remove it")
            moved[b["mnt_id"]] = roots[0]["mnt_id"]
        img["entries"] = [e for e in entries if e not in binds]
        criu_images.save(img, path)
    if moved and files_path.exists():
        img = criu_images.load(files_path)
        for e in img["entries"]:
            for body in e.values():
                if isinstance(body, dict) and body.get("mnt_id") in moved:
                    body["mnt_id"] = moved[body["mnt_id"]]
        criu_images.save(img, files_path)
    return len(moved)
