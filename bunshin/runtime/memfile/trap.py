"""Adding the trap to a converted process's images: handler areas, SIGSYS action, seccomp filter.

For each process that gets a new memory file, ``prepare`` places the handler
(``trapcode.Blob``: code r-x, table r--, state rw-) at a free address as three
more areas of that file (``Kind.TRAP``: written by the rewrite, not dumped
pages). ``install`` then points the process's SIGSYS action at the handler (the
program's own action moves into the state page) and gives every thread the
filter. A dump of a clone already holds them: recognised by the SIGSYS action
pointing at a blob whose table carries the magic, the code and state stay as
they are (the state holds the program's action), only the table is rewritten
and the filter replaced (ours is recognised by its first instruction).
"""

from __future__ import annotations

import base64
import bisect
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .criu_images import MAP_PRIVATE, PAGE, PROT_EXEC, load, save, split
from .plan import Kind, Proc
from .sites import SitesUnavailable, syscall_sites
from .trapcode import (
    SA_NODEFER,
    SA_ONSTACK,
    SA_RESTORER,
    SA_SIGINFO,
    SIGSYS,
    SIGSYS_BIT,
    STATE_SIZE,
    TABLE_SIZE,
    Blob,
    FileEntry,
    filter_program,
    is_ours,
    merge_spans,
    parse_table,
    state_bytes,
    table_bytes,
)

PROT_READ, PROT_RW = 0x1, 0x3
MAX_CODE_SPANS, MAX_CONVERTED_SPANS = 4, 16
_LOW, _HIGH = 1 << 40, 0x7FF000000000  # where a handler may be placed
_CONVERTED = (Kind.CONVERT, Kind.FILE, Kind.SHARED, Kind.REBASE)
_SIGSYS_SLOT = SIGSYS - 3  # CRIU's sigactions skip SIGKILL and SIGSTOP


class TrapUnavailable(Exception):
    """The handler cannot be given to this process (the reason is the message)."""


@dataclass
class TrapSetup:
    """Where one process's handler lies and what its filter checks."""

    base: int
    existing: bool
    sites: tuple[int, ...]
    code_spans: list[tuple[int, int]]
    converted_spans: list[tuple[int, int]]
    contents: dict[int, bytes] = field(default_factory=dict)  # vma index -> bytes of a TRAP area
    program: bytes = b""  # the filter

    def blob_range(self, blob: Blob) -> tuple[int, int]:
        return self.base, self.base + blob.size


def _sigsys(core: dict[str, Any]) -> dict[str, Any] | None:
    sa = core.get("tc", {}).get("sigactions", [])
    return sa[_SIGSYS_SLOT] if len(sa) > _SIGSYS_SLOT else None


def _find_existing(proc: Proc, core: dict[str, Any], blob: Blob) -> tuple[int, list[FileEntry]] | None:
    """(base, file entries) of the handler a clone's dump already holds, if any; TrapUnavailable
    if it is another version's (its code is not this blob's: its filter traps what it handles,
    both stay as they are)."""
    sa = _sigsys(core)
    if not sa or not sa.get("sigaction"):
        return None
    at = int(sa["sigaction"])
    code = next((i for i, v in enumerate(proc.vmas) if v["start"] <= at < v["end"]), None)
    if code is None:
        return None
    table_at = proc.vmas[code]["end"]
    i = next((j for j, v in enumerate(proc.vmas) if v["start"] == table_at), None)
    if i is None or proc.vmas[i]["end"] != table_at + TABLE_SIZE:
        return None
    raw = _area_bytes(proc, i, TABLE_SIZE)
    entries = parse_table(raw) if raw is not None else None
    if entries is None:
        return None
    base = proc.vmas[code]["start"]
    if at - base != blob.handler or _area_bytes(proc, code, len(blob.code) + 1) != blob.code:
        raise TrapUnavailable("its trap is another bunshin version's (kept as it is)")
    return base, entries


def _area_bytes(proc: Proc, i: int, n: int) -> bytes | None:
    """Up to ``n`` bytes of area ``i`` as its memory file holds them (None if unreadable)."""
    v = proc.vmas[i]
    path = proc.base_paths.get(v["shmid"])
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(v["pgoff"])
            return f.read(min(n, v["end"] - v["start"]))
    except OSError:
        return None


def _free_base(vmas: list[dict[str, Any]], size: int) -> int:
    """A page-aligned address with ``size`` bytes free around it (in the largest gap)."""
    best: tuple[int, int] | None = None
    prev = _LOW
    for v in [*sorted(vmas, key=lambda v: v["start"]), {"start": _HIGH, "end": _HIGH}]:
        a, b = max(prev, _LOW), min(v["start"], _HIGH)
        if b - a > (best[1] - best[0] if best else 0):
            best = (a, b)
        prev = max(prev, v["end"])
    if best is None or best[1] - best[0] < 4 * size:
        raise TrapUnavailable("no free address range for the SIGSYS handler")
    a, b = best
    quarter = (b - a) // 4
    return (a + quarter + secrets.randbelow(max(quarter * 2 - size, PAGE))) & ~(PAGE - 1)


def _insert(proc: Proc, new: list[dict[str, Any]]) -> list[int]:
    """Add areas (no pages) to the process's map; their indices."""
    vmas, kinds = list(proc.vmas), list(proc.kinds)
    for v in new:
        i = bisect.bisect_left([x["start"] for x in vmas], v["start"])
        vmas.insert(i, v)
        kinds.insert(i, Kind.TRAP)
    proc.mm_img["entries"][0]["vmas"] = vmas
    proc.kinds = kinds
    proc.pieces = split(proc.pm_img["entries"][1:], vmas)
    return [next(i for i, v in enumerate(vmas) if v is x) for x in new]


def _area(start: int, size: int, prot: int) -> dict[str, Any]:
    return {"start": start, "end": start + size, "pgoff": 0, "shmid": 0, "prot": prot,
            "flags": MAP_PRIVATE, "status": 0, "fd": -1}


def sigsys_held(cores: dict[int, dict[str, Any]]) -> str | None:
    """Why the trap would show: a thread of the process blocks SIGSYS.

    A trap while SIGSYS is blocked kills the process (``force_sig_seccomp``: the kernel
    unblocks it and resets its action to the default), so the trap needs it unblocked;
    taking it out of a thread's blocked set would show in what the program reads back
    (``sigprocmask``, ``/proc/PID/status``, ``sigpending``) and let a blocked
    ``kill(SIGSYS)`` through. Such a process keeps its memory anonymous instead
    (``cores``: thread id -> core entry). An action whose mask holds SIGSYS (bash's for
    its terminating signals) loses it in the kernel (``_unblock_sigsys``) and keeps it in
    the state page, where ``sigaction`` reads it back: only a SIGSYS sent while that
    handler runs is not held back.
    """
    for tid, core in sorted(cores.items()):
        for holder in (core.get("thread_core", {}), core.get("tc", {})):
            if int(holder.get("blk_sigset", 0)) & SIGSYS_BIT:
                return f"thread {tid} blocks SIGSYS"
    return None


def prepare(
    proc: Proc, blob: Blob, core: dict[str, Any], files: dict[int, dict[str, Any]], view: str, root: Path,
    threads: dict[int, dict[str, Any]] | None = None,
) -> TrapSetup:
    """Plan the trap of one process (adds or marks its TRAP areas); raises TrapUnavailable.

    ``threads``: every thread's core entry (the leader's too), for ``sigsys_held``.
    """
    mode = core.get("thread_core", {}).get("seccomp_mode", "disabled")
    if mode in ("strict", 1):
        raise TrapUnavailable("the process runs in seccomp strict mode")
    found = _find_existing(proc, core, blob)
    held = sigsys_held(threads or {proc.pid: core}) if found is None else None
    if held:
        raise TrapUnavailable(held)
    base, old_entries = found if found else (_free_base(proc.vmas, blob.size), [])
    lo, hi = base, base + blob.size
    code_at, table_at = base, base + len(blob.code)
    mine = [i for i, v in enumerate(proc.vmas) if v["start"] < hi and v["end"] > lo]
    if found is None and mine:
        raise TrapUnavailable("the handler's address range is taken")
    outside = [(i, v) for i, v in enumerate(proc.vmas) if not (v["start"] < hi and v["end"] > lo)]
    try:
        found_sites = syscall_sites(core, proc.mm_img["entries"][0], proc.vmas, files, root, (lo, hi))
    except SitesUnavailable as exc:
        raise TrapUnavailable(str(exc)) from None
    code = merge_spans(list(found_sites.spans), MAX_CODE_SPANS)
    converted = merge_spans([(v["start"], v["end"]) for i, v in outside if proc.kinds[i] in _CONVERTED],
                            MAX_CONVERTED_SPANS)
    entries = _file_entries(proc, files, old_entries, outside)
    table = table_bytes(view, lo, hi, entries) if len(view) < 111 else b""
    if not table:
        raise TrapUnavailable(f"the memory-file view {view!r} is too long for the handler")
    setup = TrapSetup(base, found is not None, found_sites.addresses, code, converted)
    try:
        setup.program = filter_program((lo, hi), setup.sites, code, converted)
    except ValueError as exc:
        raise TrapUnavailable(str(exc)) from None
    if found is None:
        idx = _insert(proc, [
            _area(code_at, len(blob.code), PROT_READ | PROT_EXEC),
            _area(table_at, TABLE_SIZE, PROT_READ),
            _area(table_at + TABLE_SIZE, STATE_SIZE, PROT_RW),
        ])
        sa = _sigsys(core) or {}
        setup.contents = {idx[0]: blob.code, idx[1]: table, idx[2]: state_bytes(sa, proc.pid, _given_masks(core))}
    else:
        i = next(i for i, v in enumerate(proc.vmas) if v["start"] == table_at)
        proc.kinds[i] = Kind.TRAP
        setup.contents = {i: table}
    return setup


def _file_entries(
    proc: Proc, files: dict[int, dict[str, Any]], old: list[FileEntry], outside: list[tuple[int, dict[str, Any]]]
) -> list[FileEntry]:
    """What DONTNEED brings back in each converted file mapping: new ones, and older ones still mapped."""
    out = []
    for i, v in outside:
        kind = proc.kinds[i]
        if kind is Kind.FILE:
            name = str(files[v["shmid"]]["reg"]["name"])
            out.append(FileEntry(v["start"], v["end"], v["pgoff"], name))
        elif kind in (Kind.SHARED, Kind.REBASE):
            for e in old:
                a, b = max(e.start, v["start"]), min(e.end, v["end"])
                if a < b:
                    out.append(FileEntry(a, b, e.off + a - e.start, e.path))
    if len(out) > (TABLE_SIZE - 144) // 256:
        raise TrapUnavailable(f"{len(out)} converted file mappings are more than the handler's table holds")
    return out


def install(
    images_dir: Path,
    pid: int,
    threads: list[int],
    blob: Blob,
    setup: TrapSetup,
    seccomp_img: dict[str, Any],
) -> list[tuple[dict[str, Any], Path]]:
    """Point SIGSYS at the handler and give each thread the filter; the core images to save.

    ``seccomp_img`` is changed in place (one image for the whole dump).
    """
    prog = setup.program
    filters: list[dict[str, Any]] = seccomp_img["entries"][0].setdefault("seccomp_filters", [])
    made: dict[int | None, int] = {}
    out = []
    cores = [(tid, images_dir / f"core-{tid}.img") for tid in threads]
    imgs = [(tid, load(path), path) for tid, path in cores]
    # CRIU dumps a filter that all threads share on the leader only (flag TSYNC: it
    # propagates on restore) and leaves the other threads' mode disabled: only the
    # threads that hold a filter get ours; if none does, every thread gets it
    held = [_has_filter(img) for _, img, _ in imgs]
    for (tid, img, path), has in zip(imgs, held, strict=True):
        core = img["entries"][0]
        tcore = core.setdefault("thread_core", {})
        _unblock_sigsys(core)
        if any(held) and not has:
            if tid == pid and not setup.existing:
                _point_sigsys(core, blob, setup)
            out.append((img, path))  # (its blocked set changed, if SIGSYS was in it: a clone's dump)
            continue
        prev: int | None = None
        flags = 0
        if has:
            prev = int(tcore["seccomp_filter"])
            top = filters[prev]
            flags = int(top.get("flags", 0))
            if is_ours(base64.b64decode(top["filter"])):  # a clone's dump: ours is replaced
                prev = int(top["prev"]) if "prev" in top else None
        if prev not in made:
            entry: dict[str, Any] = {"filter": base64.b64encode(prog).decode(), "flags": flags}
            if prev is not None:
                entry["prev"] = prev
            filters.append(entry)
            made[prev] = len(filters) - 1
        tcore["seccomp_mode"] = "filter"
        tcore["seccomp_filter"] = made[prev]
        if tid == pid and not setup.existing:
            _point_sigsys(core, blob, setup)
        out.append((img, path))
    return out


def _has_filter(img: dict[str, Any]) -> bool:
    tcore = img["entries"][0].get("thread_core", {})
    return tcore.get("seccomp_mode") in ("filter", 2) and "seccomp_filter" in tcore


def _unblock_sigsys(core: dict[str, Any]) -> None:
    """SIGSYS out of every action's mask and a task's blocked set (see ``sigsys.c``; a blocked
    set holds it only in a clone's dump: a process blocking it at the first fork stays anonymous)."""
    for holder in (core.get("thread_core", {}), core.get("tc", {})):
        if "blk_sigset" in holder:
            holder["blk_sigset"] = int(holder["blk_sigset"]) & ~SIGSYS_BIT
    for sa in core.get("tc", {}).get("sigactions", []):
        sa["mask"] = int(sa.get("mask", 0)) & ~SIGSYS_BIT


def _given_masks(core: dict[str, Any]) -> dict[int, int]:
    """Signal -> mask of each action whose mask holds SIGSYS (read back from the state page;
    CRIU's slots skip SIGKILL and SIGSTOP)."""
    out = {}
    for slot, sa in enumerate(core.get("tc", {}).get("sigactions", []), start=1):
        if int(sa.get("mask", 0)) & SIGSYS_BIT:
            out[slot + (slot >= 9) + (slot >= 18)] = int(sa["mask"])
    return out


def _point_sigsys(core: dict[str, Any], blob: Blob, setup: TrapSetup) -> None:
    sa = core["tc"]["sigactions"][_SIGSYS_SLOT]
    sa.update(sigaction=setup.base + blob.handler, restorer=setup.base + blob.restorer,
              flags=SA_SIGINFO | SA_ONSTACK | SA_RESTORER | SA_NODEFER, mask=0)


def load_seccomp(images_dir: Path) -> dict[str, Any]:
    path = images_dir / "seccomp.img"
    if path.exists():
        return load(path)
    return {"magic": "SECCOMP", "entries": [{"seccomp_filters": []}]}


__all__ = ["TrapSetup", "TrapUnavailable", "install", "load_seccomp", "prepare", "save", "sigsys_held"]
