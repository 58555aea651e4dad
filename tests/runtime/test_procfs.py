"""``kernel.procfs``: a workspace's ``proc`` is read only if it is procfs, reached without a
symlink; names under it follow no symlink, leave it by no ``..`` and cross no mount; reads are
bounded. Attacked with fake roots in temporary folders and a tmpfs mounted over part of a
procfs in a private mount namespace of a child process."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin.runtime.kernel import procfs


def _canary(tmp_path: Path) -> Path:
    """A folder shaped like a procfs of one process (pid 1, running): what a workspace would
    show the host in place of its real one."""
    fake = tmp_path / "canary"
    (fake / "1" / "task" / "1").mkdir(parents=True)
    for stat in (fake / "1" / "stat", fake / "1" / "task" / "1" / "stat"):
        stat.write_text("1 (canary) R 0 0 0\n")
    return fake


@pytest.mark.parametrize("link", ["absolute", "relative"])
def test_a_proc_that_is_a_symlink_is_refused_never_followed(tmp_path: Path, link: str) -> None:
    fake = _canary(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / "proc").symlink_to(fake if link == "absolute" else "../canary")
    with pytest.raises(procfs.NotProcfs, match="symlink"):
        procfs.open_proc(str(root))


def test_a_proc_that_is_no_procfs_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    _canary(tmp_path).rename(root / "proc")  # a real folder, of the test's own file system
    with pytest.raises(procfs.NotProcfs, match="no procfs \\(file system magic 0x"):
        procfs.open_proc(str(root))


def test_a_refusal_leaves_no_descriptor_open(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(procfs.NotProcfs):
            procfs.open_proc(str(root))
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises(FileNotFoundError):  # gone (no such root): not a refusal, an OSError as it is
        procfs.open_proc(str(tmp_path / "gone"))


def test_names_under_a_procfs_follow_no_symlink_nor_dotdot_and_reads_are_bounded() -> None:
    pid = os.getpid()
    proc = procfs.open_proc(f"/proc/{pid}/root")
    try:
        assert procfs.fs_type(proc) == procfs.PROC_SUPER_MAGIC
        stat = procfs.read_at(proc, f"{pid}/stat").decode()
        assert stat.startswith(f"{pid} (")
        assert len(procfs.read_at(proc, f"{pid}/status", 16)) == 16  # bounded
        for path, code in (("self/stat", errno.ELOOP),  # procfs' own symlink: not followed
                           (f"{pid}/cwd/etc/hostname", errno.ELOOP),  # a magic link out of it
                           ("../etc/hostname", errno.EXDEV)):  # out through ..
            with pytest.raises(OSError) as e:
                procfs.read_at(proc, path)
            assert e.value.errno == code, path
        task = procfs.open_at(proc, f"{pid}/task", directory=True)
        try:
            assert str(pid) in os.listdir(task)
        finally:
            os.close(task)
    finally:
        os.close(proc)


CROSS = """
import errno, os, subprocess, sys
from bunshin.runtime.kernel import procfs
subprocess.run(["mount", "--make-rprivate", "/"], check=True)
subprocess.run(["mount", "-t", "tmpfs", "none", "/proc/fs"], check=True)  # over a folder of procfs
os.symlink(sys.argv[1], "/proc/fs/canary")  # a symlink on the mounted file system
open("/proc/fs/plain", "w").write("over")
proc = procfs.open_proc(f"/proc/{os.getpid()}/root")
for name in ("fs/plain", "fs/canary/stat"):
    try:
        procfs.read_at(proc, name)
        print(name, "read")
    except OSError as e:
        print(name, errno.errorcode[e.errno])
"""


def test_a_file_system_mounted_over_part_of_a_procfs_is_not_crossed(tmp_path: Path) -> None:
    fake = _canary(tmp_path)
    out = subprocess.run(["unshare", "--mount", sys.executable, "-c", CROSS, str(fake / "1")],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["fs/plain EXDEV", "fs/canary/stat EXDEV"], out.stdout
