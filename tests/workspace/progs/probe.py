"""A workload for the fork tests: a heap with a checksum, and memory probes.

    probe.py HEAP_MIB

Holds a HEAP_MIB heap (every page non-zero), an 8 MiB raw mmap to grow with
mremap, a 4 MiB raw mmap to MADV_DONTNEED and an 8 MiB malloc'd block to realloc.
The host writes one request line to /tmp/probe.req (temp name, then rename); the
answer appears in /tmp/probe.out. Requests: sum, write TEXT, fresh, mremap MIB,
realloc MIB, dontneed, spawn N (N copies of this Python exec'd, each
madvising fresh memory: how many failed). /tmp/probe.ready holds the first checksum.
"""

import ctypes
import hashlib
import os
import subprocess
import sys
import time

MIB, PAGE = 1 << 20, 4096
PROT_RW, MAP_PRIVATE_ANON, MREMAP_MAYMOVE, MADV_DONTNEED = 3, 0x22, 1, 4

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.calloc.restype = ctypes.c_void_p
libc.calloc.argtypes = (ctypes.c_size_t, ctypes.c_size_t)
libc.realloc.restype = ctypes.c_void_p
libc.realloc.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.free.argtypes = (ctypes.c_void_p,)


def anon(n: int, byte: int) -> int:
    addr = libc.mmap(None, n, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    ctypes.memset(addr, byte, n)
    return addr


def read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


seed = os.urandom(16)
heap = bytearray(int(sys.argv[1]) * MIB)
for off in range(0, len(heap), PAGE):
    heap[off : off + 32] = hashlib.sha256(seed + off.to_bytes(8, "little")).digest()
grow, grow_len = anon(8 * MIB, 0x5A), 8 * MIB
dn = anon(4 * MIB, 0x77)
block = libc.malloc(8 * MIB)
ctypes.memset(block, 0x3C, 8 * MIB)


def checksum() -> str:
    return hashlib.sha256(heap).hexdigest()


def fresh() -> str:
    bad = []
    addr = libc.mmap(None, 32 * MIB, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    if read(addr, 32 * MIB).count(0) != 32 * MIB:
        bad.append("mmap")
    for size in (16, 1000, 4000, 60_000, 200_000, 4 * MIB):
        ptrs = [libc.calloc(1, size) for _ in range(64)]
        if any(read(p, size).count(0) != size for p in ptrs):
            bad.append(f"calloc({size})")
        for p in ptrs:
            libc.free(p)
    if bytearray(16 * MIB).count(0) != 16 * MIB:
        bad.append("bytearray")
    return "ok" if not bad else "stale " + ",".join(bad)


def mremap(mib: int) -> str:
    global grow, grow_len
    new_len = mib * MIB
    addr = libc.mremap(grow, grow_len, new_len, MREMAP_MAYMOVE)
    if addr in (None, ctypes.c_void_p(-1).value):
        return f"failed errno {ctypes.get_errno()}"
    old = read(addr, grow_len)
    tail = read(addr + grow_len, new_len - grow_len)
    grow, keep = addr, grow_len
    grow_len = new_len
    if old != b"\x5a" * keep:
        return "old part changed"
    return "ok" if tail.count(0) == len(tail) else f"stale tail: {len(tail) - tail.count(0)} non-zero bytes"


def realloc(mib: int) -> str:
    global block
    new = libc.realloc(block, mib * MIB)
    if not new:
        return "failed"
    block = new
    return "ok" if read(new, 8 * MIB) == b"\x3c" * (8 * MIB) else "old part changed"


def dontneed() -> str:
    libc.madvise(dn, 4 * MIB, MADV_DONTNEED)
    data = read(dn, 4 * MIB)
    return "zero" if data.count(0) == len(data) else f"stale: {len(data) - data.count(0)} non-zero bytes"


CHILD = """
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.write(b"x" * (1 << 20))
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
assert libc.madvise(addr, 1 << 20, 4) == 0 and m[:] == bytes(1 << 20)
"""


def spawn(n: int) -> str:
    bad = sum(subprocess.run([sys.executable, "-c", CHILD]).returncode != 0 for _ in range(n))
    return f"failed {bad}"


def answer(line: str) -> str:
    op, _, arg = line.strip().partition(" ")
    if op == "sum":
        return checksum()
    if op == "write":
        text = arg.encode()
        for off in range(0, len(heap), 16 * PAGE):
            heap[off : off + len(text)] = text
        return checksum()
    if op == "fresh":
        return fresh()
    if op == "mremap":
        return mremap(int(arg))
    if op == "realloc":
        return realloc(int(arg))
    if op == "dontneed":
        return dontneed()
    if op == "spawn":
        return spawn(int(arg))
    return f"unknown request {op!r}"


def publish(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)


publish("/tmp/probe.ready", checksum())
while True:
    try:
        with open("/tmp/probe.req") as f:
            line = f.read()
        os.unlink("/tmp/probe.req")
    except FileNotFoundError:
        time.sleep(0.01)
        continue
    try:
        out = answer(line)
    except Exception as e:  # report, keep serving
        out = f"error {e!r}"
    publish("/tmp/probe.out", out)
