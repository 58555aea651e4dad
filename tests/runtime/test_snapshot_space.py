"""The fork's space check (``snapshot._check_space``): a snapshot that bunshin's tmpfs cannot
hold is refused before anything is frozen, and loses nothing; one that fits is taken."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin import Workspace
from bunshin.config import Config
from bunshin.errors import ResourceExhausted
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.state.store import Store
from tests.conftest import drop_state_tmpfs, leftovers

pytestmark = [pytest.mark.integration, pytest.mark.criu]

MIB = 1 << 20
TMPFS_MIB = 192

# holds 256 MiB of written anonymous memory (more than the whole tmpfs) until /tmp/stop appears
HOG = r"""
import os, time
big = bytearray(256 << 20)
for i in range(0, len(big), 4096):
    big[i] = 1
open("/tmp/ready", "w").write("1")
while not os.path.exists("/tmp/stop"):
    time.sleep(0.02)
"""


@contextlib.contextmanager
def _home_on_tmpfs(tmp_path: Path, cfg: Config, mib: int) -> Iterator[Config]:
    """A private home whose tmpfs (at its usual place, which workspaces' user namespaces can
    reach) is mounted by the test at ``mib`` MiB before bunshin's first use, unmounted after."""
    home = Config.for_home(tmp_path / "home", criu=cfg.criu)
    home.tmpfs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0755", "bunshin", str(home.tmpfs)], check=True)
    try:
        yield home
    finally:
        drop_state_tmpfs(home)
        while os.path.ismount(home.tmpfs):
            subprocess.run(["umount", "-l", str(home.tmpfs)], check=False)
        if home.tmpfs.is_dir():
            home.tmpfs.rmdir()


@pytest.fixture
def small_home(tmp_path: Path, cfg: Config) -> Iterator[Config]:
    """A private home on a 192 MiB tmpfs of the test's own."""
    with _home_on_tmpfs(tmp_path, cfg, TMPFS_MIB) as home:
        yield home


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _wait(ws: Workspace, path: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if ws.exec(["test", "-s", path]).exit_code == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never appeared in {ws.id}")


@pytest.mark.parametrize("precopy", [False, True], ids=["dump", "precopy"])
def test_a_snapshot_the_tmpfs_cannot_hold_is_refused_before_anything_is_frozen(small_home, precopy):
    """Also with live pre-copy on for every process of 16 MiB: the check comes before it, so
    no live file is started in a tmpfs that cannot hold it."""
    small_home = dataclasses.replace(small_home, fork_precopy=precopy, fork_precopy_min_mib=16)
    ws = Workspace.create("host", memory="1G", pids=64, config=small_home)
    try:
        ws.commands.spawn(["python3", "-c", HOG])
        _wait(ws, "/tmp/ready")
        free_before = _free(small_home.tmpfs)
        assert free_before < 256 * MIB  # the hog's memory cannot fit: the check must see it
        with pytest.raises(ResourceExhausted, match=r"MiB free, the snapshot of .* needs about") as err:
            ws.snapshot()
        assert "BUNSHIN_TMPFS" in (err.value.hint or "")
        # nothing was frozen, written or recorded: the workspace and its hog run on
        assert ws.exec("echo alive").stdout == "alive\n"
        assert ws.exec(["test", "-e", "/tmp/ready"]).exit_code == 0
        with Store.open(small_home.db_path) as store:
            assert rsnap.list_all(store) == []
        assert sorted(p.name for p in small_home.paths.snapshots.iterdir()) == []
        mem = small_home.paths.mem  # no live file was started either
        assert not mem.is_dir() or sorted(p.name for p in mem.iterdir()) == []
        assert abs(_free(small_home.tmpfs) - free_before) < 8 * MIB

        # the same workspace without the hog fits, and forks
        ws.exec(["touch", "/tmp/stop"])
        deadline = time.monotonic() + 30
        while ws.exec(["pgrep", "-f", "bytearray"]).exit_code == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        snap = ws.snapshot()
        try:
            (clone,) = snap.restore(1)
            try:
                assert clone.exec("cat /tmp/ready").stdout == "1"
            finally:
                clone.remove()
        finally:
            snap.remove()
    finally:
        ws.remove()
    assert leftovers(small_home) == {}


# 256 MiB of random bytes (two of pre-copy's 128 MiB pieces), idle, answering their hash on request
HEAP = r"""
import hashlib, os, random, time
rnd = random.Random(7)
big = bytearray(256 << 20)
for i in range(0, len(big), 1 << 20):
    big[i:i + (1 << 20)] = rnd.randbytes(1 << 20)
open("/tmp/ready", "w").write(hashlib.sha256(big).hexdigest())
while True:
    if os.path.exists("/tmp/req"):
        os.unlink("/tmp/req")
        open("/tmp/ans.tmp", "w").write(hashlib.sha256(big).hexdigest()); os.replace("/tmp/ans.tmp", "/tmp/ans")
    time.sleep(0.02)
"""


def _heap_hash(ws: Workspace) -> str:
    r = ws.exec(["sh", "-c", "rm -f /tmp/ans; touch /tmp/req; while [ ! -s /tmp/ans ]; do sleep 0.02; done; cat /tmp/ans"],
                timeout=60)
    assert r.exit_code == 0, r
    return r.stdout


def test_a_tmpfs_filled_during_the_pre_copy_refuses_the_fork_and_loses_nothing(tmp_path, cfg, monkeypatch):
    """Another workspace fills the tmpfs while a first fork pre-copies (here: the moment the
    first piece is copied and bound): the pieces mapped already stay exact, the rest stays
    anonymous, the fork is refused with what to do, and once there is room it forks, exactly."""
    with _home_on_tmpfs(tmp_path, cfg, 448) as home:
        _fill_during_the_pre_copy(dataclasses.replace(home, fork_precopy=True, fork_precopy_min_mib=16), monkeypatch)
        assert leftovers(home) == {}


def _fill_during_the_pre_copy(home: Config, monkeypatch) -> None:
    from bunshin.runtime.memfile import live_bind

    filler = home.tmpfs / "filler"
    real_bind, filled = live_bind.bind, []

    def bind_then_fill(*args, **kwargs):
        real_bind(*args, **kwargs)
        if not filled:  # once, leaving 8 MiB: the first piece's few dirty pages fit, the second piece does not
            filled.append(filler)
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, _free(home.tmpfs) - 8 * MIB)
            finally:
                os.close(fd)

    monkeypatch.setattr(live_bind, "bind", bind_then_fill)
    ws = Workspace.create("host", memory="1G", pids=64, config=home)
    try:
        ws.commands.spawn(["python3", "-c", HEAP])
        _wait(ws, "/tmp/ready")
        want = ws.exec(["cat", "/tmp/ready"]).stdout
        with pytest.raises(ResourceExhausted, match="MiB free, the snapshot of"):
            ws.snapshot()
        assert filler.exists()  # the tmpfs was filled mid-way, as meant
        assert _heap_hash(ws) == want  # the piece in the live file and the one left anonymous: exact
        with Store.open(home.db_path) as store:
            assert rsnap.list_all(store) == []
        maps = ws.exec(["sh", "-c", "grep -c /.bunshin/mem/ /proc/$(pgrep -x python3)/maps"]).stdout
        assert int(maps) >= 1  # the first piece is mapped from its file, through the bind

        filler.unlink()  # room again: the same workspace forks, its clone exact
        snap = ws.snapshot()
        try:
            (clone,) = snap.restore(1)
            try:
                assert _heap_hash(clone) == want
            finally:
                clone.remove()
        finally:
            snap.remove()
        assert _heap_hash(ws) == want
    finally:
        ws.remove()
