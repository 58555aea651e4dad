"""The trap's parts as bytes: the SIGSYS handler blob, its table and state, its seccomp filter.

``sigsys.c`` is compiled once per source and cache folder (``gcc -nostdlib -fPIC
-O2``, no libc, no relocations) into a blob of whole pages. In a process it is
followed by a read-only table (``TABLE_SIZE``) and a writable state page: the
layout the C code assumes. The filter is classic BPF, appended to the process's
seccomp chain: for ``madvise`` with advice DONTNEED, DONTNEED_LOCKED, FREE or
WIPEONFORK and for ``mremap`` it returns ``SECCOMP_RET_TRAP`` only when the call
comes from a system call site of the code the process had at dump time (``sites``)
and aims at memory converted then; from that code too ``rt_sigaction`` (of SIGSYS, or setting
an action) and ``rt_sigprocmask`` that may block: the handler keeps SIGSYS
unblocked (a seccomp trap while SIGSYS is blocked kills the process). Calls from
the blob itself always pass. Both limits keep a program exec'd in a clone (which
has no handler: the filter survives ``execve``, the handler does not) out of
the trap but for a coincidence of addresses (see the package doc).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from bunshin.errors import HostUnsupported

from .criu_images import PAGE

MAGIC = 0x50415254534E5542  # "BUNSTRAP"
VERSION = 1
TRAP_DATA = 0x6B5  # SECCOMP_RET_DATA of our traps: the handler's si_errno
FILTER_MARK = 0x62756E73  # first instruction of our filter loads it: how a dump's copy is recognised
TABLE_SIZE = 64 << 10
STATE_SIZE = PAGE
_HEADER = struct.Struct("<QIIQQ112s")
_FENT = struct.Struct("<QQQ232s")
MAX_FILES = (TABLE_SIZE - _HEADER.size) // _FENT.size
_STATE = struct.Struct("<QQQQQqQ64Q")  # magic, the program's SIGSYS action, owner, held, masks

NR_MADVISE, NR_MREMAP, NR_RT_SIGACTION, NR_RT_SIGPROCMASK = 28, 25, 13, 14
NR_RT_SIGPENDING, NR_CLONE, NR_EXECVE, NR_EXECVEAT = 127, 56, 59, 322
CLONE_VM = 0x100
SIGSYS = 31
SIGSYS_BIT = 1 << (SIGSYS - 1)
MADV_DONTNEED, MADV_FREE, MADV_WIPEONFORK, MADV_DONTNEED_LOCKED = 4, 8, 18, 24
TRAPPED_ADVICE = (MADV_DONTNEED, MADV_FREE, MADV_WIPEONFORK, MADV_DONTNEED_LOCKED)
SA_SIGINFO, SA_ONSTACK, SA_RESTORER, SA_NODEFER = 0x4, 0x08000000, 0x04000000, 0x40000000

_CFLAGS = (
    "-nostdlib", "-fPIC", "-O2", "-ffreestanding", "-fno-builtin", "-fno-stack-protector",
    "-fno-asynchronous-unwind-tables", "-fno-tree-loop-distribute-patterns",
    "-fcf-protection=none", "-fvisibility=hidden", "-Wall", "-Werror",
)
_LINKER_SCRIPT = """SECTIONS {
  . = 0;
  __blob_start = .;
  .text : { *(.text .text.*) *(.rodata .rodata.*) }
  . = ALIGN(4096);
  __code_end = .;
  /DISCARD/ : { *(.comment) *(.note*) *(.eh_frame*) }
}
"""


@dataclass(frozen=True)
class Blob:
    """The compiled handler: its code (whole pages) and where its entry points lie."""

    code: bytes
    handler: int  # offset of bunshin_sigsys
    restorer: int  # offset of the sa_restorer (rt_sigreturn)

    @property
    def size(self) -> int:
        """Code, table and state: the address range a process gives the trap."""
        return len(self.code) + TABLE_SIZE + STATE_SIZE


def _source() -> bytes:
    return resources.files(__package__).joinpath("sigsys.c").read_bytes()


def build_blob(cache_dir: Path) -> Blob:
    """The handler blob, compiled into ``cache_dir`` the first time (keyed by source and flags)."""
    src = _source()
    key = hashlib.sha256(src + " ".join(_CFLAGS).encode() + _LINKER_SCRIPT.encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"sigsys-{key}.bin"
    if not path.exists():
        _compile(src, path)
    raw = path.read_bytes()
    handler, restorer, size = struct.unpack_from("<QQQ", raw)
    code = raw[24:]
    if len(code) != size or size % PAGE or not handler < size or not restorer < size:
        raise HostUnsupported(f"{path} is not a handler blob", hint=f"delete {path}; it is rebuilt")
    return Blob(code, handler, restorer)


def _compile(src: bytes, out: Path) -> None:
    gcc, objcopy, nm = shutil.which("gcc"), shutil.which("objcopy"), shutil.which("nm")
    if gcc is None or objcopy is None or nm is None:
        raise HostUnsupported(
            "gcc and binutils are needed to build the SIGSYS handler of converted memory",
            hint="install gcc (make install does)",
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bunshin-sigsys-") as tmp:
        t = Path(tmp)
        (t / "sigsys.c").write_bytes(src)
        (t / "blob.ld").write_text(_LINKER_SCRIPT)
        steps = [
            [gcc, *_CFLAGS, "-c", "-o", str(t / "sigsys.o"), str(t / "sigsys.c")],
            [gcc, "-nostdlib", "-static", "-Wl,--build-id=none", "-Wl,-T," + str(t / "blob.ld"),
             "-o", str(t / "blob.elf"), str(t / "sigsys.o")],
            [objcopy, "-O", "binary", "-j", ".text", str(t / "blob.elf"), str(t / "blob.bin")],
        ]
        for argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise HostUnsupported(
                    f"building the SIGSYS handler failed: {proc.stderr.strip()[-400:]}",
                    hint="check that gcc works (make install installs it)",
                )
        syms = {}
        listing = subprocess.run([nm, str(t / "blob.elf")], capture_output=True, text=True, check=True)
        for line in listing.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3:
                syms[parts[2]] = int(parts[0], 16)
        code_end = syms["__code_end"]
        code = (t / "blob.bin").read_bytes()
        if len(code) > code_end:
            raise HostUnsupported("the SIGSYS handler has data outside its code", hint="report this")
        code = code.ljust(code_end, b"\0")
        head = struct.pack("<QQQ", syms["bunshin_sigsys"], syms["bunshin_sigsys_restorer"], code_end)
        tmp_out = out.with_name(out.name + f".{os.getpid()}.tmp")
        tmp_out.write_bytes(head + code)
        os.replace(tmp_out, out)


# ------------------------------------------------------------------ table and state


@dataclass(frozen=True)
class FileEntry:
    """A converted private file mapping: DONTNEED on [start, end) maps ``path`` at ``off`` again."""

    start: int
    end: int
    off: int  # the file's offset at ``start``
    path: str


def table_bytes(view: str, blob_lo: int, blob_hi: int, files: list[FileEntry]) -> bytes:
    """The handler's table: where converted memory's files lie and what file mappings held."""
    prefix = view.rstrip("/").encode() + b"/"
    if len(prefix) >= 112:
        raise ValueError(f"memory-file view {view!r} is too long for the trap's table")
    if len(files) > MAX_FILES:
        raise ValueError(f"{len(files)} converted file mappings, the trap's table holds {MAX_FILES}")
    out = bytearray(_HEADER.pack(MAGIC, VERSION, len(files), blob_lo, blob_hi, prefix))
    for f in files:
        path = f.path.encode()
        if len(path) >= 232:
            raise ValueError(f"file name {f.path!r} is too long for the trap's table")
        out += _FENT.pack(f.start, f.end, f.off, path)
    return bytes(out.ljust(TABLE_SIZE, b"\0"))


def parse_table(raw: bytes) -> list[FileEntry] | None:
    """The file entries of a table (None if ``raw`` is not one of this version)."""
    if len(raw) < _HEADER.size:
        return None
    magic, version, n, _lo, _hi, _view = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or n > MAX_FILES:
        return None
    out = []
    for i in range(n):
        start, end, off, path = _FENT.unpack_from(raw, _HEADER.size + i * _FENT.size)
        out.append(FileEntry(start, end, off, path.rstrip(b"\0").decode(errors="replace")))
    return out


def state_bytes(prog: dict[str, int], pid: int, masks: dict[int, int] | None = None) -> bytes:
    """The handler's state page: the program's own SIGSYS action (a CRIU sa_entry), its pid,
    and the masks holding SIGSYS the program gave other signals' actions (``masks``: signal ->
    mask; the kernel's lack SIGSYS, ``sigaction`` reads these back)."""
    masks = {sig: m for sig, m in (masks or {}).items() if 1 <= sig <= 64 and m & SIGSYS_BIT}
    held = sum(1 << (sig - 1) for sig in masks)
    raw = _STATE.pack(MAGIC, prog.get("sigaction", 0), prog.get("flags", 0),
                      prog.get("restorer", 0), prog.get("mask", 0) & ~SIGSYS_BIT, pid, held,
                      *(masks.get(sig, 0) for sig in range(1, 65)))
    return raw.ljust(STATE_SIZE, b"\0")


# ------------------------------------------------------------------ the seccomp filter

_LD_IMM, _LD_ABS, _LD_MEM, _ST, _TAX = 0x00, 0x20, 0x60, 0x02, 0x07
_ADD_X, _ADD_K, _JA, _JEQ, _JGT, _JGE, _JSET, _JGE_X, _RET = 0x0C, 0x04, 0x05, 0x15, 0x25, 0x35, 0x45, 0x3D, 0x06
RET_ALLOW, RET_TRAP = 0x7FFF0000, 0x00030000
AUDIT_ARCH_X86_64 = 0xC000003E
_NR, _ARCH, _IP = 0, 4, 8


def _arg(i: int, hi: bool = False) -> int:
    return 16 + 8 * i + (4 if hi else 0)


class _Asm:
    """Classic BPF with labels; every conditional jump goes through ``ja`` (32-bit offsets)."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int, int, int | str]] = []
        self.labels: dict[str, int] = {}
        self.n = 0

    def op(self, code: int, k: int | str = 0) -> None:
        self.code.append((code, 0, 0, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def fresh(self) -> str:
        self.n += 1
        return f"_{self.n}"

    def jump(self, code: int, k: int, t: str, f: str) -> None:
        """if (A op k) goto t else goto f."""
        self.code.append((code, 0, 1, k))
        self.op(_JA, t)
        self.op(_JA, f)

    def lt64(self, hi: tuple[int, int], lo: tuple[int, int], c: int, t: str, f: str) -> None:
        """if the 64-bit value (loads ``hi``, ``lo``) < c goto t else f."""
        low = self.fresh()
        self.op(*hi)
        self.jump(_JGT, c >> 32, f, nxt := self.fresh())
        self.label(nxt)
        self.jump(_JEQ, c >> 32, low, t)
        self.label(low)
        self.op(*lo)
        self.jump(_JGE, c & 0xFFFFFFFF, f, t)

    def gt64(self, hi: tuple[int, int], lo: tuple[int, int], c: int, t: str, f: str) -> None:
        """if the 64-bit value > c goto t else f."""
        low = self.fresh()
        self.op(*hi)
        self.jump(_JGT, c >> 32, t, nxt := self.fresh())
        self.label(nxt)
        self.jump(_JEQ, c >> 32, low, f)
        self.label(low)
        self.op(*lo)
        self.jump(_JGT, c & 0xFFFFFFFF, t, f)

    def in64(self, hi: tuple[int, int], lo: tuple[int, int], a: int, b: int, t: str, f: str) -> None:
        """if a <= value < b goto t else f."""
        below = self.fresh()
        self.lt64(hi, lo, a, f, below)
        self.label(below)
        self.lt64(hi, lo, b, t, f)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.code):
            if isinstance(k, str):
                k = self.labels[k] - i - 1
                if k < 0:
                    raise ValueError("a BPF jump may only go forward")
            out += struct.pack("<HBBI", code, jt, jf, k)
        return bytes(out)


def merge_spans(spans: list[tuple[int, int]], limit: int) -> list[tuple[int, int]]:
    """Sorted, disjoint spans covering ``spans``; the closest neighbours joined until at most ``limit``."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda j: out[j + 1][0] - out[j][1])
        out[i][1] = out[i + 1][1]
        del out[i + 1]
    return [(a, b) for a, b in out]


BPF_MAXINSNS = 4096
_BLOCK = 32  # call sites compared one by one after a range test


def _ip_in_sites(p: _Asm, sites: tuple[int, ...], ok: str, no: str) -> None:
    """if the instruction pointer is one of ``sites`` (sorted) goto ok else no."""
    groups: dict[int, list[int]] = {}
    for a in sites:
        groups.setdefault(a >> 32, []).append(a & 0xFFFFFFFF)
    for hi, los in sorted(groups.items()):
        other = p.fresh()
        p.op(_LD_ABS, _IP + 4)
        p.jump(_JEQ, hi, here := p.fresh(), other)
        p.label(here)
        p.op(_LD_ABS, _IP)
        for i in range(0, len(los), _BLOCK):
            block, after = los[i : i + _BLOCK], p.fresh()
            p.jump(_JGT, block[-1], after, inside := p.fresh())
            p.label(inside)
            for lo in block:
                p.code.append((_JEQ, 0, 1, lo))
                p.op(_JA, ok)
            p.op(_JA, no)
            p.label(after)
        p.op(_JA, no)
        p.label(other)
    p.op(_JA, no)


def filter_program(
    blob: tuple[int, int],
    sites: tuple[int, ...],
    code: list[tuple[int, int]],
    converted: list[tuple[int, int]],
) -> bytes:
    """The filter for one process: calls from ``sites`` or ``code`` spans, on ``converted`` memory."""
    p = _Asm()
    ip = ((_LD_ABS, _IP + 4), (_LD_ABS, _IP))
    a0 = ((_LD_ABS, _arg(0, True)), (_LD_ABS, _arg(0)))
    end = ((_LD_MEM, 1), (_LD_MEM, 0))
    p.op(_LD_IMM, FILTER_MARK)
    p.op(_LD_ABS, _ARCH)
    p.jump(_JEQ, AUDIT_ARCH_X86_64, "nr", "allow")
    p.label("nr")
    p.op(_LD_ABS, _NR)
    p.jump(_JEQ, NR_MADVISE, "madvise", "nr2")
    p.label("nr2")
    p.jump(_JEQ, NR_MREMAP, "mremap", "nr3")
    p.label("nr3")
    p.jump(_JEQ, NR_RT_SIGACTION, "sigaction", "nr4")
    p.label("nr4")
    # every rt_sigprocmask and rt_sigpending (each thread's SIGSYS block lives in the handler's
    # state), execve (that block made real first), fork (the child's state keeps the forker's)
    for i, nr in enumerate((NR_RT_SIGPROCMASK, NR_RT_SIGPENDING, NR_EXECVE, NR_EXECVEAT)):
        p.jump(_JEQ, nr, "signal_ok", f"nr{5 + i}")
        p.label(f"nr{5 + i}")
    p.jump(_JEQ, NR_CLONE, "clone", "allow")
    p.label("madvise")
    p.op(_LD_ABS, _arg(2))
    for adv in TRAPPED_ADVICE:
        nxt = p.fresh()
        p.jump(_JEQ, adv, "madvise_ok", nxt)
        p.label(nxt)
    p.op(_JA, "allow")
    # clone: a fork (no CLONE_VM, no new stack) only
    p.label("clone")
    p.op(_LD_ABS, _arg(0))
    p.jump(_JSET, CLONE_VM, "allow", "clone_sp")
    p.label("clone_sp")
    p.op(_LD_ABS, _arg(1))
    p.jump(_JEQ, 0, "clone_sp_hi", "allow")
    p.label("clone_sp_hi")
    p.op(_LD_ABS, _arg(1, True))
    p.jump(_JEQ, 0, "signal_ok", "allow")
    # rt_sigaction: SIGSYS's (kept by the handler), or any that sets or reads an action (its
    # sa_mask loses SIGSYS, read back as given)
    p.label("sigaction")
    p.op(_LD_ABS, _arg(0))
    p.jump(_JEQ, SIGSYS, "sig_hi", "sa_act")
    p.label("sig_hi")
    p.op(_LD_ABS, _arg(0, True))
    p.jump(_JEQ, 0, "signal_ok", "sa_act")
    # any other action set or read: the mask the program gave (SIGSYS in it) is read back
    for arg, name, nxt in ((1, "sa_act", "sa_old"), (2, "sa_old", "allow")):  # act, then oldact
        p.label(name)
        p.op(_LD_ABS, _arg(arg))
        p.jump(_JEQ, 0, f"{name}_hi", "signal_ok")
        p.label(f"{name}_hi")
        p.op(_LD_ABS, _arg(arg, True))
        p.jump(_JEQ, 0, nxt, "signal_ok")
    for kind, name in enumerate(("madvise_ok", "mremap", "signal_ok")):
        p.label(name)
        p.op(_LD_IMM, kind)
        p.op(_ST, 2)
        p.op(_JA, "ip")
    p.label("ip")
    p.in64(*ip, blob[0], blob[1], "allow", "ip0")
    for i, (a, b) in enumerate(code):
        p.label(f"ip{i}")
        p.in64(*ip, a, b, "ip_ok", f"ip{i + 1}")
    p.label(f"ip{len(code)}")
    _ip_in_sites(p, sites, "ip_ok", "allow")
    p.label("ip_ok")
    p.op(_LD_MEM, 2)
    p.jump(_JEQ, 2, "trap", "k1")
    p.label("k1")
    p.jump(_JEQ, 1, "mremap_range", "madvise_range")
    # madvise: [arg0, arg0 + arg1) meets a converted span (the sum kept in M[0], M[1])
    p.label("madvise_range")
    p.op(_LD_ABS, _arg(0))
    p.op(_TAX)
    p.op(_LD_ABS, _arg(1))
    p.op(_ADD_X)
    p.op(_ST, 0)
    p.code.append((_JGE_X, 0, 1, 0))
    p.op(_JA, "nocarry")
    p.op(_LD_IMM, 1)
    p.op(_JA, "hi")
    p.label("nocarry")
    p.op(_LD_IMM, 0)
    p.label("hi")
    p.op(_ST, 1)
    p.op(_LD_ABS, _arg(0, True))
    p.op(_TAX)
    p.op(_LD_MEM, 1)
    p.op(_ADD_X)
    p.op(_TAX)
    p.op(_LD_ABS, _arg(1, True))
    p.op(_ADD_X)
    p.op(_ST, 1)
    for i, (a, b) in enumerate(converted):
        p.label(f"r{i}")
        p.lt64(*a0, b, f"r{i}e", f"r{i + 1}")
        p.label(f"r{i}e")
        p.gt64(*end, a, "trap", f"r{i + 1}")
    p.label(f"r{len(converted)}")
    p.op(_JA, "allow")
    # mremap: arg0 inside a converted span (an mremap's old range lies in one area)
    p.label("mremap_range")
    for i, (a, b) in enumerate(converted):
        p.label(f"m{i}")
        p.in64(*a0, a, b, "trap", f"m{i + 1}")
    p.label(f"m{len(converted)}")
    p.op(_JA, "allow")
    p.label("trap")
    p.op(_RET, RET_TRAP | TRAP_DATA)
    p.label("allow")
    p.op(_RET, RET_ALLOW)
    if len(p.code) > BPF_MAXINSNS:
        raise ValueError(f"the trap's filter needs {len(p.code)} instructions, BPF allows {BPF_MAXINSNS}")
    return p.assemble()


def is_ours(filter_bytes: bytes) -> bool:
    """Whether a dumped filter is one this module wrote (its first instruction loads the mark)."""
    return len(filter_bytes) >= 8 and struct.unpack_from("<HBBI", filter_bytes) == (_LD_IMM, 0, 0, FILTER_MARK)
