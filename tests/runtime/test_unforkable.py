"""Units of ``runtime/unforkable`` on this process and fresh ones (no workspace, no root):
the ghost limit's sizes, a deleted-but-open file found by size, an inotify watch found
through fdinfo and mapped to its mount by the kernel's device encoding."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bunshin.config import DEFAULT_GHOST_LIMIT, Config
from bunshin.errors import InvalidArgument
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.snapshot import unforkable

_libc = ctypes.CDLL(None, use_errno=True)
IN_CREATE = 0x100


@pytest.mark.parametrize(("raw", "size"), [(DEFAULT_GHOST_LIMIT, 256 << 20), (123, 123), ("64M", 64 << 20),
                                           ("1g", 1 << 30), (" 512KiB ", 512 << 10), ("2048", 2048)])
def test_ghost_limit_sizes(raw, size):
    assert unforkable.ghost_limit(dataclasses.replace(Config(), ghost_limit=raw)) == size


@pytest.mark.parametrize("raw", ["", "lots", "0", "-5", -5, "1T", "1.5G", True, None])
def test_ghost_limit_that_is_no_size_is_refused_with_a_hint(raw):
    with pytest.raises(InvalidArgument) as info:
        unforkable.ghost_limit(dataclasses.replace(Config(), ghost_limit=raw))
    assert "BUNSHIN_GHOST_LIMIT" in (info.value.hint or "")


@pytest.fixture
def holder() -> Iterator[Callable[[Path, int, int], tuple[int, int]]]:
    """A fresh process (none of this one's descriptors: a test run may hold deleted logs of
    its own) that opens a file, writes ``size`` bytes, makes it ``length`` long, and keeps it
    open: (its pid, the descriptor's number)."""
    procs: list[subprocess.Popen[str]] = []

    def start(path: Path, size: int, length: int) -> tuple[int, int]:
        code = (f"import os, sys; f = open({str(path)!r}, 'wb'); f.write(b'x' * {size}); f.flush(); "
                f"f.truncate({length}); print(f.fileno(), flush=True); sys.stdin.read()")
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None
        return p.pid, int(p.stdout.readline())

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_deleted_open_file_is_found_only_above_the_limit(tmp_path: Path, holder):
    path = tmp_path / "spill"
    pid, fd = holder(path, 5000, 5000)
    assert unforkable.big_ghost(pid, 4096) is None, "not deleted yet"
    path.unlink()
    held = os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512  # what CRIU counts: the bytes allocated
    assert held >= 5000
    assert unforkable.big_ghost(pid, 4096) == (fd, str(path), held)
    assert unforkable.big_ghost(pid, held) is None, "at the limit is within it"


def test_a_sparse_deleted_file_counts_by_what_it_holds(tmp_path: Path, holder):
    path = tmp_path / "sparse"
    pid, _ = holder(path, 0, 1 << 30)  # 1 GiB long, nothing written
    path.unlink()
    assert unforkable.big_ghost(pid, 1 << 20) is None


def test_an_inotify_watch_is_mapped_to_its_mount(tmp_path: Path):
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0
    try:
        assert _libc.inotify_add_watch(fd, b"/proc", IN_CREATE) > 0
        found = unforkable.stuck_watch(os.getpid())
        assert found is not None and found[0] == fd
        _, ino, mount = found
        assert ino == os.stat("/proc").st_ino
        assert mount is not None and mount.fs_type == "proc" and mount.mount_point == "/proc"
        assert not unforkable.decodes_handles(mount)
        st = os.stat("/proc")
        assert (mount.major, mount.minor) == (os.major(st.st_dev), os.minor(st.st_dev))
    finally:
        os.close(fd)


def test_which_filesystems_decode_handles():
    def entry(fs: str, opts: str = "rw") -> mountinfo.MountEntry:
        return mountinfo.MountEntry.parse(f"36 35 0:5 / /x rw - {fs} src {opts}")

    assert unforkable.decodes_handles(entry("overlay", "rw,lowerdir=/a,upperdir=/u,index=on,nfs_export=on"))
    assert not unforkable.decodes_handles(entry("overlay", "rw,lowerdir=/a,upperdir=/u"))
    assert unforkable.decodes_handles(entry("ext4")) and unforkable.decodes_handles(entry("tmpfs"))
    assert not unforkable.decodes_handles(entry("devpts")) and not unforkable.decodes_handles(entry("proc"))


def test_nothing_is_looked_for_that_criu_did_not_name(tmp_path: Path, holder):
    """A ghost above the limit does not explain a failure CRIU gave another reason for."""
    path = tmp_path / "spill"
    pid, _ = holder(path, 5000, 5000)
    path.unlink()
    cfg = dataclasses.replace(Config(), ghost_limit=4096)
    assert unforkable.find(cfg, "ws-x", pid, "Error (criu/sk-inet.c): no") is None
    err = unforkable.find(cfg, "ws-x", pid, "Error (criu/files-reg.c): Can't dump ghost file")
    assert err is not None and err.details["path"] == str(path) and err.details["size"] >= 5000
    assert err.details["command"].startswith(sys.executable) and str(path) in err.message
