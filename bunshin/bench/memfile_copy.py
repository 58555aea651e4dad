"""``bunshin bench memfile-copy``: how fast dumped pages move into memory files.

A source file of ``mib`` MiB of random bytes (a share ``zero_share`` of its pages
zeros) is written on the snapshot images tmpfs (``huge=within_size``, where CRIU
writes its pages), then copied into a memory file on bunshin's ``huge=advise``
tmpfs by each method, ``rounds`` times, methods alternated:

- ``write_data_huge``: ``memfile.fileio.write_data(huge=True)``, what the rewrite uses
  (dense 2 MiB regions as huge pages, zero pages as holes);
- ``write_data``: the same without huge pages;
- ``copy_file_range``: the kernel's copy (``fileio.copy_range``), zero pages written too;
- ``pread_pwrite``: 2 MiB reads and writes through a buffer, zero pages written too.

Each copy is checked byte for byte against the source. On a VM that reports free memory
to its host (virtio-balloon free page reporting: ``/sys/module/page_reporting``), memory
freed a few seconds ago is slow to allocate again, huge pages most: with every method in a
run, each copy takes memory the previous ones freed and the host took back (the slow case);
``--methods write_data_huge`` alone reuses the last copy's huge pages at once (the rewrite's
case: it punches the image's pages as it fills the memory file). Result (``--json``):
``r["methods"][name]["gb_per_s"]`` (every round), ``..._p50``, ``["huge_mib"]`` (the
system-wide ``ShmemHugePages`` growth during each copy: other work on the machine shows in
it too) and ``["data_mib"]`` (the memory file's blocks: zero pages left as holes do not count).
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..runtime.container import statefs
from ..runtime.memfile import fileio

HUGE = 2 << 20
PAGE = 4096
Copy = Callable[[int, int, int], None]  # (src fd, dst fd, bytes)


def _write_data_huge(src: int, dst: int, n: int) -> None:
    fileio.write_data(src, 0, dst, 0, n, huge=True)


def _write_data(src: int, dst: int, n: int) -> None:
    fileio.write_data(src, 0, dst, 0, n)


def _copy_file_range(src: int, dst: int, n: int) -> None:
    fileio.copy_range(src, 0, dst, 0, n)


def _pread_pwrite(src: int, dst: int, n: int) -> None:
    buf = bytearray(HUGE)
    for off in range(0, n, HUGE):
        got = os.preadv(src, [buf], off)
        os.pwrite(dst, memoryview(buf)[:got], off)


METHODS: dict[str, Copy] = {
    "write_data_huge": _write_data_huge,
    "write_data": _write_data,
    "copy_file_range": _copy_file_range,
    "pread_pwrite": _pread_pwrite,
}


def _shmem_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1]) << 10
    return 0


def _make_source(path: Path, n: int, zero_share: float) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.ftruncate(fd, n)
    rnd = random.Random(17)
    chunk = rnd.randbytes(HUGE)
    with mmap.mmap(fd, n) as m:
        for off in range(0, n, HUGE):
            m[off : off + HUGE] = chunk
        for off in range(0, n, PAGE):
            if rnd.random() < zero_share:
                m[off : off + PAGE] = bytes(PAGE)
    return fd


def _same(a: int, b: int, n: int) -> bool:
    """Byte for byte, by ``pread``: a read of a hole allocates nothing (a mapping's fault would)."""
    return all(os.pread(a, HUGE, o) == os.pread(b, HUGE, o) for o in range(0, n, HUGE))


def _one(copy: Copy, src: int, dst_path: Path, n: int) -> dict[str, float]:
    dst = os.open(dst_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(dst, n)
        huge0 = _shmem_huge_bytes()
        t = time.perf_counter()
        copy(src, dst, n)
        dt = time.perf_counter() - t
        huge = _shmem_huge_bytes() - huge0
        data = os.fstat(dst).st_blocks * 512
        if not _same(src, dst, n):
            raise RuntimeError(f"the copy into {dst_path} differs from its source")  # a bug, not bad input
        return {"s": dt, "huge_mib": max(huge, 0) / (1 << 20), "data_mib": data / (1 << 20)}
    finally:
        os.close(dst)
        dst_path.unlink()


def run(cfg: Config, *, mib: int = 1024, rounds: int = 3, zero_share: float = 0.0,
        methods: tuple[str, ...] = tuple(METHODS)) -> dict[str, Any]:
    """Copy ``mib`` MiB by every method ``rounds`` times (alternated); GB/s and huge pages per round."""
    if mib < 2 or mib % 2:
        raise InvalidArgument(f"--mib must be an even number of MiB >= 2, not {mib}", hint="e.g. --mib 1024")
    if rounds < 1 or not 0.0 <= zero_share < 1.0:
        raise InvalidArgument("rounds must be >= 1 and the zero share in [0, 1)", hint="e.g. --rounds 3 --zero-share 0.2")
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise InvalidArgument(f"unknown method(s): {', '.join(sorted(unknown))}", hint=f"one of {', '.join(METHODS)}")
    n = mib << 20
    statefs.ensure(cfg)
    images, mem = statefs.images_root(cfg), cfg.tmpfs
    tag = f"bench-memfile-copy-{os.getpid()}"
    src_path = images / f"{tag}.src"
    src = _make_source(src_path, n, zero_share)
    per: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    try:
        for r in range(rounds):
            for name in methods if r % 2 == 0 else tuple(reversed(methods)):
                per[name].append(_one(METHODS[name], src, mem / f"{tag}.{name}", n))
    finally:
        os.close(src)
        src_path.unlink()
    out: dict[str, Any] = {"mib": mib, "rounds": rounds, "zero_share": zero_share,
                           "huge_memfiles": statefs.huge_memfiles(cfg), "methods": {}}
    for name, rows in per.items():
        rates = [round(n / row["s"] / 1e9, 2) for row in rows]
        out["methods"][name] = {"gb_per_s": rates, "gb_per_s_p50": statistics.median(rates),
                                "huge_mib": [round(row["huge_mib"]) for row in rows],
                                "data_mib": round(rows[-1]["data_mib"])}
    out["load_1min"] = os.getloadavg()[0]
    return out


def print_report(r: dict[str, Any]) -> None:
    rows = [(name, m["gb_per_s_p50"], ", ".join(map(str, m["gb_per_s"])), ", ".join(map(str, m["huge_mib"])),
             m["data_mib"]) for name, m in r["methods"].items()]
    output.print_table(f"{r['mib']} MiB into a memory file ({r['zero_share']:.0%} zero pages, "
                       f"load {r['load_1min']:.1f})", ["method", "GB/s p50", "GB/s per round", "huge MiB", "data MiB"], rows)
