"""Live conversion: a running process's anonymous areas moved into a memory file, pre-copied while it runs.

``convert_live`` (issue 17's pre-copy), piece by piece (``CHUNK`` bytes of an area):

1. *track*: every area is registered and write-protected (``dirty.Tracker``:
   async write-protect) before anything is copied;
2. *pre-copy* of a piece, the process running: its populated pages are copied
   into the memory file (holes stay holes), then a second round copies what it
   wrote meanwhile;
3. *stop*: every thread stopped (``inject.Stopped``); the first time, each area
   must still be mapped whole as it was, else nothing is changed and
   ``LiveUnavailable`` says why;
4. *dirty copy*: only the pages of the piece written since its last round;
5. *remap*: the file (sealed from the process's side: mode 0444) is opened in the
   process (its own path, ``view``, verified from the host by device and inode
   before anything maps it) and the piece is replaced by a ``MAP_PRIVATE |
   MAP_FIXED`` mapping of its slot, same address and protection; its anonymous
   pages are freed, and the next piece's copy reuses them.

One piece at a time, not the whole process first: the copy never holds more than
a piece twice, and its pages are those the last remap freed, which this VM hands
out at once (memory freed long ago has been given back to the host, and its first
touch costs a fault there: ~4 s per GiB measured, see the README). No huge pages:
the file's huge pages come from that given-back memory.

With ``trap`` (the handler blob) the process also gets the trap a restored
clone gets (``live_trap``: handler areas from the same file, SIGSYS action,
SIGSYS unblocked, the filter), installed at the first stop, before any area maps
the file, so converted memory keeps anonymous memory's semantics. The process then
reads the same bytes from the shared file, as a restored clone does, and a CRIU dump
of it holds only what it writes afterwards; the dump's rewrite finds the file and
the trap as in a clone's. ``live_areas`` picks the areas (as ``plan.convertible``).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunshin.runtime.dirty import Area, Run, Tracker, TrackingUnavailable
from bunshin.runtime.inject import InjectionFailed, Stopped, check

from . import live_trap, vmcopy
from .criu_images import PAGE
from .fileio import remove_memfile, remove_memfile_at, seal, write_data
from .rewrite import DEFAULT_GROWTH_ROOM, Slots
from .trap import TrapUnavailable
from .trapcode import Blob

NR_MMAP, NR_MUNMAP, NR_CLOSE, NR_OPENAT = 9, 11, 3, 257
CHUNK = 128 << 20  # copied, then mapped from the file, per stop: the process runs between pieces
DIRECT = True  # pre-copy with process_vm_readv (``vmcopy.copy_runs_buffered``; else pread of /proc/PID/mem)
THREADS = 2  # its copies side by side (this machine has two cores)
PROT_RW = 0x3
MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x02, 0x10, 0x20
O_RDONLY, O_NONBLOCK, O_NOFOLLOW, O_CLOEXEC, O_NOCTTY = 0, 0o4000, 0o400000, 0o2000000, 0o400
AT_FDCWD = -100
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


_How = tuple[bool, "Callable[[], os.stat_result] | None", "Callable[[], None] | None"]  # immutable, seen_as, publish


class LiveUnavailable(Exception):
    """The process cannot be converted live (the reason is the message); it was left as it was."""


class _PartlyMapped(LiveUnavailable):
    """The process maps the file already (the trap, or pieces with the same bytes): the file stays."""


@dataclass(frozen=True)
class LiveArea:
    start: int
    end: int
    prot: int
    offset: int  # of its slot in the memory file


@dataclass
class LiveResult:
    """What a live conversion did, and how long each phase took (ms)."""

    path: Path
    areas: list[LiveArea]
    precopy_ms: float = 0.0  # while the process ran (all pieces' rounds)
    stop_ms: float = 0.0  # stopping every thread
    dirty_ms: float = 0.0  # copying the pages written during the pre-copy (stopped)
    remap_ms: float = 0.0  # trap and remap (stopped)
    trap_ms: float = 0.0  # of which: planning and installing the trap
    map_ms: float = 0.0  # of which: the MAP_FIXED mappings (freeing the anonymous pages)
    publish_ms: float = 0.0  # making the file reachable at its view (the process running)
    pause_ms: float = 0.0  # the longest time the process was stopped at once
    stopped_ms: float = 0.0  # all its stops together
    stops: int = 0  # one per piece of at most CHUNK bytes
    precopy_bytes: int = 0
    dirty_bytes: int = 0
    rounds: list[int] = field(default_factory=list)  # bytes written meanwhile, per later round (all pieces)
    pass_ms: list[float] = field(default_factory=list)  # per round, all pieces (the first: everything)
    left: list[tuple[int, int]] = field(default_factory=list)  # pieces changed before their turn: anonymous still
    cut_short: str = ""  # why the pieces after the first that failed were left anonymous (e.g. a full tmpfs)


def alive_or_refuse(pidfd: int, pid: int) -> None:
    """LiveUnavailable unless the process ``pidfd`` names still lives (so ``pid`` is still its)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        raise LiveUnavailable(f"process {pid} exited (its pid may be another process's now)") from None


def _area_prot(pid: int, start: int, end: int) -> int | None:
    """The protection of the area mapped exactly ``[start, end)``, anonymous and private; else None."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo == start and hi == end:
            perms, inode = parts[1], parts[4]
            if perms[3] != "p" or inode != "0":
                return None
            return (1 if perms[0] == "r" else 0) | (2 if perms[1] == "w" else 0) | (4 if perms[2] == "x" else 0)
    return None


_SMAPS_HEAD = re.compile(r"[0-9a-f]+-[0-9a-f]+ ")
_PLAIN_FLAGS = frozenset({"rd", "wr", "mr", "mw", "me", "ac", "nr", "hg", "nh", "sd"})


def live_areas(pid: int, *, convert_heap: bool = True) -> list[tuple[int, int]]:
    """The plain private anonymous areas of ``pid`` holding pages (as ``plan.convertible``, from smaps):
    no stacks, locked, shared, executable, hugetlb, wipe-on-fork or merged (KSM) memory."""
    return [(a, b) for a, b, _ in live_areas_held(pid, convert_heap=convert_heap)]


def live_areas_held(pid: int, *, convert_heap: bool = True) -> list[tuple[int, int, int]]:
    """``live_areas`` with the bytes each holds (resident or swapped)."""
    out = []
    head: list[str] | None = None
    rss = 0

    def flush(flags: list[str]) -> None:
        if head is None:
            return
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        name = head[5] if len(head) > 5 else ""
        if (head[1][3] == "p" and head[4] == "0" and (name == "" or (convert_heap and name == "[heap]"))
                and "wr" in flags and set(flags) <= _PLAIN_FLAGS and rss > 0):
            out.append((lo, hi, rss << 10))

    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        key = line.split(":", 1)[0]
        if _SMAPS_HEAD.match(line):
            head, rss = line.split(maxsplit=5), 0
        elif key in ("Rss", "Swap"):
            rss += int(line.split()[1])
        elif key == "VmFlags":
            flush(line.split()[1:])
            head = None
    return out


def _punch(fd: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _copy(mem: int, dst: int, area: LiveArea, runs: list[Run], fresh: bool) -> int:
    total = 0
    for lo, hi in ((r.start, r.end) for r in runs):
        at = area.offset + lo - area.start
        if not fresh:
            _punch(dst, at, hi - lo)  # the older copy out: a page now all zeros becomes a hole
        total += write_data(mem, lo, dst, at, hi - lo)
    return total


def _precopy(pid: int, pidfd: int, mem: int, dst: int, area: LiveArea, runs: list[Run], fresh: bool) -> int:
    """A pre-copy round's copy of ``runs`` (the process running), over what an earlier round wrote
    there (every byte of a run is written): with ``process_vm_readv`` through a private buffer, the
    pidfd asked before the bytes reach the file (``vmcopy.copy_runs_buffered``: the file may be
    readable from inside by then), unless not ``DIRECT``."""
    if not DIRECT:
        return _copy(mem, dst, area, runs, fresh)
    return vmcopy.copy_runs_buffered(pid, dst, area.offset - area.start, [(r.start, r.end) for r in runs],
                                     check_alive=lambda: alive_or_refuse(pidfd, pid), threads=THREADS)


def convert_live(
    pid: int, areas: list[tuple[int, int]], path: Path, view: str, *,
    growth_room: int = DEFAULT_GROWTH_ROOM, rounds: int = 2, trap: Blob | None = None,
    immutable: bool = True, dir_fd: int | None = None, seen_as: Callable[[], os.stat_result] | None = None,
    pidfd: int | None = None, publish: Callable[[], None] | None = None,
) -> LiveResult:
    """Move ``areas`` (whole private anonymous areas of ``pid``) into a new memory file at ``path``.

    ``view`` is the file's path as the process resolves it. ``rounds``: pre-copy
    passes while it runs (each copies what the previous one saw written).
    ``trap``: the handler blob; given, the process also gets the trap
    (``live_trap``), so converted memory keeps anonymous memory's semantics.
    The file is sealed (mode 0444, and the immutable flag unless not
    ``immutable``) before the process opens it. ``dir_fd``: ``path`` is a name
    in that folder (made and removed there, never following a symlink).
    ``seen_as``: the file as the process's view shows it (an overlay reports its
    own device and inode), which the file it opened must be; else the file itself.
    ``pidfd``: the process meant (else one is opened now): a pid reused meanwhile
    by another process is refused at every stop. ``publish``: called once the
    first piece is pre-copied, before the first stop, to make the file reachable at ``view``
    (``live_bind``); an ``OSError`` it raises refuses the conversion.
    Raises ``LiveUnavailable`` (the process unchanged, the file removed), but
    for a failure after the first area was mapped from the file: the areas
    mapped already hold the same bytes (and the trap), and the file stays.
    """
    slots = Slots(growth_room)
    planned = []
    for start, end in sorted(areas):
        prot = _area_prot(pid, start, end)
        if prot is None:
            raise LiveUnavailable(f"{start:#x}-{end:#x} is not one private anonymous area of process {pid}")
        planned.append(LiveArea(start, end, prot, slots.place(start, end - start)))
    own_pidfd = None
    if pidfd is None:
        try:
            pidfd = own_pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise LiveUnavailable(f"process {pid} is gone") from None
    try:
        return _convert(pid, planned, slots, path, view, rounds, trap, (immutable, seen_as, publish), dir_fd, pidfd)
    finally:
        if own_pidfd is not None:
            os.close(own_pidfd)


def _convert(pid: int, planned: list[LiveArea], slots: Slots, path: Path, view: str, rounds: int,
             trap: Blob | None, how: _How, dir_fd: int | None, pidfd: int) -> LiveResult:
    dst = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    done = False
    try:
        os.ftruncate(dst, slots.cursor)
        result = LiveResult(path, planned)
        try:
            with Tracker.open(pid, pidfd=pidfd) as tracker:
                _run(pid, tracker, slots, dst, view, result, rounds, trap, how, pidfd)
        except _PartlyMapped:
            done = True
            raise
        except (TrackingUnavailable, InjectionFailed, TrapUnavailable, OSError) as exc:
            raise LiveUnavailable(str(exc)) from None
        done = True
        return result
    finally:
        os.close(dst)
        if not done:  # (sealed already if the remap was refused)
            if dir_fd is None:
                remove_memfile(path)
            else:
                remove_memfile_at(dir_fd, str(path))


def _run(pid: int, tracker: Tracker, slots: Slots, dst: int, view: str,
         result: LiveResult, rounds: int, trap: Blob | None, how: _How, pidfd: int) -> None:
    planned = result.areas
    t0 = time.perf_counter()
    for a in planned:
        tracker.track(a.start, a.end)
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        alive_or_refuse(pidfd, pid)  # alive after the open: the pid was still its, the descriptor is its memory
        result.precopy_ms = (time.perf_counter() - t0) * 1000  # (the tracking counts as the first round's)
        _add(result.pass_ms, 0, result.precopy_ms)
        tracked = dict(zip(planned, tracker.areas, strict=True))
        pieces = [(a, lo, min(lo + CHUNK, a.end)) for a in planned for lo in range(a.start, a.end, CHUNK)]
        immutable, seen_as, publish = how
        setup = None
        for k, (a, lo, hi) in enumerate(pieces):
            try:
                tp = time.perf_counter()
                if not _precopy_piece(pid, pidfd, mem, dst, tracker, (a, lo, hi), rounds, result):
                    if k == 0:
                        raise LiveUnavailable(f"area {a.start:#x}-{a.end:#x} changed during the pre-copy")
                    result.left.append((lo, hi))  # changed since (unmapped, moved): not ours to map any more
                    result.precopy_ms += (time.perf_counter() - tp) * 1000
                    continue
                result.precopy_ms += (time.perf_counter() - tp) * 1000
                if k == 0 and publish is not None:
                    t1 = time.perf_counter()
                    publish()
                    result.publish_ms = (time.perf_counter() - t1) * 1000
                t1 = time.perf_counter()
                with Stopped(pid, pidfd=pidfd) as s:
                    t2 = time.perf_counter()
                    result.stop_ms += (t2 - t1) * 1000
                    if k == 0:  # nothing changes unless every area is as planned
                        for b in planned:
                            if tracker.written(tracked[b], protect=False) is None or _area_prot(pid, b.start, b.end) != b.prot:
                                raise LiveUnavailable(f"area {b.start:#x}-{b.end:#x} changed during the pre-copy")
                    runs = tracker.written(Area(lo, hi))
                    if runs is None or _area_prot_within(pid, lo, hi) != a.prot:
                        result.left.append((lo, hi))  # changed since (unmapped, moved): not ours to map any more
                        result.stopped_ms += (time.perf_counter() - t1) * 1000
                        continue
                    result.dirty_bytes += _copy(mem, dst, LiveArea(lo, hi, a.prot, a.offset + lo - a.start), runs,
                                                fresh=False)
                    t3 = time.perf_counter()
                    result.dirty_ms += (t3 - t2) * 1000
                    if k == 0 and trap is not None:
                        setup = live_trap.plan(pid, trap, str(Path(view).parent), [(b.start, b.end) for b in planned])
                        setup.offset = slots.place(setup.base, setup.size)
                        os.ftruncate(dst, slots.cursor)
                    if k == 0:
                        os.fchmod(dst, 0o444)  # (the host's descriptor still writes: later pieces' pages)
                        _map_piece(s, pid, dst, view, seen_as, setup, (a, lo, hi), False, result)
                    else:
                        _map_piece(s, pid, dst, view, seen_as, None, (a, lo, hi), True, result)
                    result.remap_ms += (time.perf_counter() - t3) * 1000
                stopped = (time.perf_counter() - t1) * 1000
                result.pause_ms = max(result.pause_ms, stopped)
                result.stopped_ms += stopped
                result.stops += 1
            except (TrackingUnavailable, InjectionFailed, LiveUnavailable, OSError) as exc:
                if k == 0:
                    raise
                # a later piece failed (its copy found the tmpfs full, its remap was refused): the
                # pieces mapped already are exact (trap and file), this one and the rest stay anonymous
                result.left += [(lo2, hi2) for _, lo2, hi2 in pieces[k:]]
                result.cut_short = str(exc) or type(exc).__name__
                break
        if immutable:
            seal(dst)
    finally:
        os.close(mem)


def _precopy_piece(pid: int, pidfd: int, mem: int, dst: int, tracker: Tracker, piece: tuple[LiveArea, int, int],
                   rounds: int, result: LiveResult) -> bool:
    """Pre-copy one piece while the process runs: what it holds (in memory: ``_precopy``; swapped or
    never touched since tracking began, the write-protect markers: read, zeros left holes), then
    ``rounds - 1`` rounds of what it wrote meanwhile. False if it is not tracked whole any more."""
    a, lo, hi = piece
    t = time.perf_counter()
    result.precopy_bytes += _precopy(pid, pidfd, mem, dst, a, tracker.present(lo, hi), True)
    result.precopy_bytes += _copy(mem, dst, a, tracker.swapped(lo, hi), fresh=True)
    _add(result.pass_ms, 0, (time.perf_counter() - t) * 1000)
    for r in range(1, max(rounds, 1)):
        t = time.perf_counter()
        runs = tracker.written(Area(lo, hi))
        if runs is None:
            return False
        n = _precopy(pid, pidfd, mem, dst, a, runs, False)
        _add(result.rounds, r - 1, n)
        _add(result.pass_ms, r, (time.perf_counter() - t) * 1000)
    return True


def _add(totals: list[Any], i: int, value: float) -> None:
    """``totals[i] += value``, the list grown as needed (a sum per round over the pieces)."""
    totals.extend([0] * (i + 1 - len(totals)))
    totals[i] += value


def _area_prot_within(pid: int, lo: int, hi: int) -> int | None:
    """The protection of the private anonymous area holding all of ``[lo, hi)``; else None."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        a, b = (int(x, 16) for x in parts[0].split("-"))
        if a <= lo and hi <= b:
            perms, inode = parts[1], parts[4]
            if perms[3] != "p" or inode != "0":
                return None
            return (1 if perms[0] == "r" else 0) | (2 if perms[1] == "w" else 0) | (4 if perms[2] == "x" else 0)
    return None


def _map_piece(s: Stopped, pid: int, dst: int, view: str, seen_as: Callable[[], os.stat_result] | None,
               setup: live_trap.LivePlan | None, piece: tuple[LiveArea, int, int], mapped: bool,
               result: LiveResult) -> None:
    """Open the file in the process by ``view`` (checked), give it the trap (the first time), map one piece."""
    a, lo, hi = piece
    raw = view.encode() + b"\0"
    if len(raw) > PAGE or b"\0" in raw[:-1]:
        raise LiveUnavailable(f"bad memory-file path {view!r}")
    t0 = time.perf_counter()
    scratch = check(s.syscall(NR_MMAP, 0, live_trap.SCRATCH, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0),
                    "mmap of a scratch area")
    fd = -1
    try:
        if setup is not None:
            os.pwrite(dst, live_trap.blob_bytes(s, setup, scratch), setup.offset)
        live_trap.write_mem(pid, scratch, raw)
        fd = check(s.syscall(NR_OPENAT, AT_FDCWD, scratch, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC),
                   f"open of {view}")
        got, want = os.stat(f"/proc/{pid}/fd/{fd}"), (seen_as() if seen_as else os.fstat(dst))
        if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
            raise (_PartlyMapped if mapped else LiveUnavailable)(f"{view} in process {pid} is not the memory file")
        if setup is not None:
            live_trap.install(s, setup, fd, scratch)  # before any area maps the file: nothing converted lacks it
        result.trap_ms += (time.perf_counter() - t0) * 1000
        t1 = time.perf_counter()
        # same bytes, same address: the process cannot tell but by its maps
        at = s.syscall(NR_MMAP, lo, hi - lo, a.prot, MAP_PRIVATE | MAP_FIXED, fd, a.offset + lo - a.start)
        if at != lo:
            what = f"mmap of {lo:#x}-{hi:#x} from the memory file failed ({at})"
            raise (_PartlyMapped(what) if mapped or setup else InjectionFailed(what))
        result.map_ms += (time.perf_counter() - t1) * 1000
    finally:
        if fd >= 0:
            s.syscall(NR_CLOSE, fd)
        s.syscall(NR_MUNMAP, scratch, live_trap.SCRATCH)
