"""The trap (``trap``, ``trapcode``) given to a live process: what a restored clone gets from its images.

``plan`` (the process stopped): a free address for the handler blob, the
process's system call sites read from its mapped code through
``/proc/PID/mem`` (the bytes it runs, not a path it names), the filter over
them and the converted areas, and the blob's bytes (code, table, state). The
caller writes those bytes into the memory file, then ``install`` maps them
there (r-x, r--, rw-, private), reads the program's SIGSYS action into the
state page's copy... in that order: SIGSYS pointed at the handler first (it
forwards traps that are not ours to the program's action), SIGSYS taken out of
every action's mask and every thread's blocked set, then the filter for all
threads (``SECCOMP_FILTER_FLAG_TSYNC``). A later CRIU dump finds all of it as
in a clone's (``trap._find_existing``).
"""

from __future__ import annotations

import contextlib
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from bunshin.runtime.inject import InjectionFailed, Stopped, check

from .criu_images import PAGE
from .sites import ADDR_NO_RANDOMIZE, MAX_SITES
from .trap import MAX_CODE_SPANS, MAX_CONVERTED_SPANS, TrapUnavailable, _free_base
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
    filter_program,
    merge_spans,
    state_bytes,
    table_bytes,
)

NR_RT_SIGACTION, NR_RT_SIGPROCMASK, NR_GETPID, NR_MMAP, NR_SECCOMP = 13, 14, 39, 9, 317
SIG_UNBLOCK = 1
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 1, 1
MAP_PRIVATE, MAP_FIXED = 0x02, 0x10
PROT_R, PROT_RX, PROT_RW = 0x1, 0x5, 0x3
_SIGACT = struct.Struct("<QQQQ")  # the kernel's sigaction: handler, flags, restorer, mask
_SCAN_LIMIT = 256 << 20
_ET_EXEC, _PT_INTERP = 2, 3
SCRATCH = 64 << 10  # what the caller's scratch mapping must hold: the filter (<= 32 KiB) and an action


@dataclass
class LivePlan:
    base: int
    blob: Blob
    table: bytes
    program: bytes
    offset: int = 0  # of the blob in the memory file (set by the caller)

    @property
    def size(self) -> int:
        return self.blob.size


@dataclass(frozen=True)
class _Map:
    start: int
    end: int
    perms: str
    offset: int
    inode: int
    name: str


def _maps(pid: int) -> list[_Map]:
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        out.append(_Map(lo, hi, parts[1], int(parts[2], 16), int(parts[4]), parts[5] if len(parts) > 5 else ""))
    return out


def _exe_text_skipped(pid: int, maps: list[_Map]) -> int | None:
    """The inode of a non-PIE, dynamically linked executable (its text is not a site); refuses a static one."""
    exe = Path(f"/proc/{pid}/exe")
    try:
        st = exe.stat()
    except OSError:
        return None
    head_map = next((m for m in maps if m.inode == st.st_ino and m.offset == 0), None)
    if head_map is None:
        return None
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(head_map.start)
        head = mem.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or struct.unpack_from("<H", head, 16)[0] != _ET_EXEC:
            return None
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        mem.seek(head_map.start + phoff)
        table = mem.read(phentsize * min(phnum, 256))
    types = {struct.unpack_from("<I", table, i)[0] for i in range(0, len(table) - 3, max(phentsize, 4))}
    if _PT_INTERP not in types:
        raise TrapUnavailable("its executable is statically linked and not position-independent")
    return st.st_ino


def _sites(pid: int, maps: list[_Map]) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    personality = int(Path(f"/proc/{pid}/personality").read_text(), 16)
    if personality & ADDR_NO_RANDOMIZE:
        raise TrapUnavailable("it runs without address randomisation (programs it execs would share its addresses)")
    fixed = _exe_text_skipped(pid, maps)
    addresses: set[int] = set()
    spans: list[tuple[int, int]] = []
    scanned = 0
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for m in maps:
            if "x" not in m.perms or m.name in ("[vdso]", "[vvar]", "[vsyscall]", "[vvar_vclock]"):
                continue
            if fixed is not None and m.inode == fixed:
                continue
            if m.inode == 0:
                spans.append((m.start, m.end))  # anonymous code (a JIT): admitted whole
                continue
            scanned += m.end - m.start
            if scanned > _SCAN_LIMIT:
                raise TrapUnavailable("it maps more executable code than is scanned for system calls")
            mem.seek(m.start)
            try:
                data = mem.read(m.end - m.start)
            except OSError:
                raise TrapUnavailable(f"its code at {m.start:#x} cannot be read") from None
            addresses.update(m.start + x.start() + 2 for x in re.finditer(b"\x0f\x05", data))
            if len(addresses) > MAX_SITES:
                raise TrapUnavailable(f"its code has more than {MAX_SITES} system call sites")
    return tuple(sorted(addresses)), spans


def _refuse_blocked(pid: int) -> None:
    """TrapUnavailable if a thread blocks SIGSYS (``trap.sigsys_held``: unblocking it would show)."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("SigBlk:") and int(line.split()[1], 16) & SIGSYS_BIT:
                    raise TrapUnavailable(f"thread {task.name} blocks SIGSYS")


def plan(pid: int, blob: Blob, view: str, converted: list[tuple[int, int]]) -> LivePlan:
    """The trap of a stopped process whose ``converted`` areas will map a memory file under ``view``."""
    _refuse_blocked(pid)
    maps = _maps(pid)
    base = _free_base([{"start": m.start, "end": m.end} for m in maps], blob.size)
    sites, spans = _sites(pid, maps)
    try:
        program = filter_program((base, base + blob.size), sites, merge_spans(spans, MAX_CODE_SPANS),
                                 merge_spans(converted, MAX_CONVERTED_SPANS))
        table = table_bytes(view, base, base + blob.size, [])
    except ValueError as exc:
        raise TrapUnavailable(str(exc)) from None
    return LivePlan(base, blob, table, program)


def blob_bytes(s: Stopped, p: LivePlan, scratch: int) -> bytes:
    """Code, table and state as they go into the memory file (the state holds the program's SIGSYS action)."""
    given = {}  # actions whose mask holds SIGSYS: ``install`` takes it out, the state page keeps it
    for sig in range(1, 65):
        if sig not in (9, 19, SIGSYS) and s.syscall(NR_RT_SIGACTION, sig, 0, scratch, 8) == 0:
            mask = _SIGACT.unpack(_read(s.pid, scratch, _SIGACT.size))[3]
            if mask & SIGSYS_BIT:
                given[sig] = mask
    check(s.syscall(NR_RT_SIGACTION, SIGSYS, 0, scratch, 8), "reading the SIGSYS action")
    handler, flags, restorer, mask = _SIGACT.unpack(_read(s.pid, scratch, _SIGACT.size))
    own_pid = check(s.syscall(NR_GETPID), "getpid")
    state = state_bytes({"sigaction": handler, "flags": flags, "restorer": restorer, "mask": mask}, own_pid, given)
    assert len(p.table) == TABLE_SIZE and len(state) == STATE_SIZE
    return p.blob.code + p.table + state


def install(s: Stopped, p: LivePlan, fd: int, scratch: int) -> None:
    """Map the blob from ``fd`` (open in the process), point SIGSYS at it, unblock SIGSYS, add the filter."""
    code, table_at = len(p.blob.code), p.base + len(p.blob.code)
    for at, size, prot, off in ((p.base, code, PROT_RX, p.offset),
                                (table_at, TABLE_SIZE, PROT_R, p.offset + code),
                                (table_at + TABLE_SIZE, STATE_SIZE, PROT_RW, p.offset + code + TABLE_SIZE)):
        got = s.syscall(NR_MMAP, at, size, prot, MAP_PRIVATE | MAP_FIXED, fd, off)
        if got != at:
            raise InjectionFailed(f"mapping the SIGSYS handler failed ({got})")
    act = _SIGACT.pack(p.base + p.blob.handler, SA_SIGINFO | SA_ONSTACK | SA_RESTORER | SA_NODEFER,
                       p.base + p.blob.restorer, 0)
    write_mem(s.pid, scratch, act)
    check(s.syscall(NR_RT_SIGACTION, SIGSYS, scratch, 0, 8), "pointing SIGSYS at the handler")
    for sig in range(1, 65):
        if sig in (9, 19, SIGSYS):  # SIGKILL and SIGSTOP have none; SIGSYS's is ours
            continue
        if s.syscall(NR_RT_SIGACTION, sig, 0, scratch, 8) < 0:
            continue
        handler, flags, restorer, mask = _SIGACT.unpack(_read(s.pid, scratch, _SIGACT.size))
        if mask & SIGSYS_BIT:
            write_mem(s.pid, scratch, _SIGACT.pack(handler, flags, restorer, mask & ~SIGSYS_BIT))
            check(s.syscall(NR_RT_SIGACTION, sig, scratch, 0, 8), f"taking SIGSYS out of signal {sig}'s mask")
    write_mem(s.pid, scratch, struct.pack("<Q", SIGSYS_BIT))
    for tid in s.threads:
        check(s.syscall(NR_RT_SIGPROCMASK, SIG_UNBLOCK, scratch, 0, 8, tid=tid), f"unblocking SIGSYS in {tid}")
    prog_at = scratch + PAGE
    write_mem(s.pid, prog_at, p.program)
    write_mem(s.pid, scratch, struct.pack("<HxxxxxxQ", len(p.program) // 8, prog_at))
    res = s.syscall(NR_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, scratch)
    if res != 0:
        raise InjectionFailed(f"adding the trap's filter failed ({res})")


def _read(pid: int, at: int, n: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(at)
        return mem.read(n)


def write_mem(pid: int, at: int, data: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(at)
        mem.write(data)
