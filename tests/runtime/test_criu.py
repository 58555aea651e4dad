"""The CRIU wrapper against the real binary: version, check, dump, detached restores, errors."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import CriuError, HostUnsupported
from bunshin.runtime.criu import run as criu

from .procs import PR_SET_CHILD_SUBREAPER, kill_and_wait, prctl

CRIU = Config.from_env().criu

# A counter that reports its value into OUT/<host pid> on SIGUSR1.
COUNTER = r"""
import os, signal, sys, time
os.setsid()
out, n = sys.argv[1], 0
def report(*_):
    me = os.readlink("/proc/self")
    with open(f"{out}/{me}.tmp", "w") as f:
        f.write(str(n))
    os.replace(f"{out}/{me}.tmp", f"{out}/{me}")
signal.signal(signal.SIGUSR1, report)
while True:
    n += 1
    time.sleep(0.005)
"""


class Counters:
    """Counter processes in their own pid namespaces; everything is killed on close."""

    def __init__(self, workdir: Path) -> None:
        self.out = workdir / "out"
        self.out.mkdir()
        self.pids: list[int] = []
        self.popens: list[subprocess.Popen[bytes]] = []

    def spawn(self) -> int:
        p = subprocess.Popen(
            ["unshare", "--pid", "--fork", sys.executable, "-c", COUNTER, str(self.out)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            cwd=self.out,  # CRIU's parasite mounts its /proc at ./proc.crtools: a folder of this test's own
        )
        self.popens.append(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"unshare exited with {p.returncode}")
            kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
            if kids:
                pid = int(kids[0])
                self.pids.append(pid)
                self.value(pid)  # wait until it answers
                return pid
            time.sleep(0.01)
        raise TimeoutError("counter did not start")

    def value(self, pid: int, timeout: float = 30) -> int:
        path = self.out / str(pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            path.unlink(missing_ok=True)
            os.kill(pid, signal.SIGUSR1)
            for _ in range(100):
                if path.exists():
                    return int(path.read_text())
                time.sleep(0.005)
        raise TimeoutError(f"{pid} does not report")

    def wait_above(self, pid: int, value: int, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.value(pid) > value:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        for pid in reversed(self.pids):
            kill_and_wait(pid)
        for p in self.popens:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def criu_bin() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not CRIU.exists():
        pytest.skip(f"no CRIU at {CRIU}")
    prctl(PR_SET_CHILD_SUBREAPER, 1)  # restored tasks become our children: reap them
    yield CRIU
    prctl(PR_SET_CHILD_SUBREAPER, 0)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, removed afterwards (images are large)."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture
def counters(criu_bin: Path, workdir: Path) -> Iterator[Counters]:
    c = Counters(workdir)
    yield c
    c.close()


def test_missing_binary_is_host_unsupported(tmp_path: Path) -> None:
    with pytest.raises(HostUnsupported):
        criu.version(tmp_path / "no-criu")
    with pytest.raises(HostUnsupported):
        criu.dump(tmp_path / "no-criu", 1, tmp_path / "img")
    ok, output = criu.check(tmp_path / "no-criu")
    assert not ok and output


@pytest.mark.criu
def test_version_and_check(criu_bin: Path) -> None:
    version = criu.version(criu_bin)
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?.*", version)
    assert tuple(int(x) for x in version.split(".")[:2]) >= (4, 2)
    ok, output = criu.check(criu_bin)
    assert ok, output


@pytest.mark.criu
def test_dump_and_restore_side_by_side(counters: Counters, criu_bin: Path, workdir: Path) -> None:
    pid = counters.spawn()
    images = workdir / "img"
    run = criu.dump(criu_bin, pid, images)
    at_dump = counters.value(pid)
    assert run.duration_ms > 0 and run.log == images / "dump.log" and run.log.exists()
    assert (images / "pstree.img").exists()

    clones = []
    for i in range(2):
        r = criu.restore(criu_bin, images, pidfile=workdir / f"clone{i}.pid", keep_log=i == 0)
        assert r.pid is not None and r.log.parent == images
        assert r.log.exists() == (i == 0)  # keep_log=False: a successful restore's log is deleted
        counters.pids.append(r.pid)
        clones.append(r.pid)
    assert len({pid, *clones}) == 3
    for c in clones:
        # each clone is the init of its own new pid namespace and continues counting
        nspid = [
            line
            for line in Path(f"/proc/{c}/status").read_text().splitlines()
            if line.startswith("NSpid:")
        ][0]
        assert nspid.split()[1:] == [str(c), "1"]
        first = counters.value(c)
        assert 0 < first <= at_dump + 10_000
        assert counters.wait_above(c, first)
    assert counters.value(pid) >= at_dump  # the parent kept running


@pytest.mark.criu
def test_extra_arguments_reach_criu(counters: Counters, criu_bin: Path, workdir: Path) -> None:
    pid = counters.spawn()
    with pytest.raises(CriuError) as info:
        criu.dump(criu_bin, pid, workdir / "img", extra=["--no-such-option"])
    assert "no-such-option" in info.value.log_tail or "unrecognized" in info.value.log_tail
    assert counters.value(pid) > 0  # a failed dump leaves the task running


@pytest.mark.criu
def test_failures_carry_the_log_tail(criu_bin: Path, workdir: Path) -> None:
    with pytest.raises(CriuError) as info:
        criu.dump(criu_bin, 2**22 + 12345, workdir / "dump")
    err = info.value
    assert err.code == "criu_error" and err.details["action"] == "dump"
    assert "Error" in err.log_tail and len(err.log_tail.splitlines()) <= criu.LOG_TAIL_LINES
    assert "criu log tail" in str(err)

    empty = workdir / "empty"
    empty.mkdir()
    with pytest.raises(CriuError) as info:
        criu.restore(criu_bin, empty, pidfile=workdir / "x.pid", log_name="restore.log")
    assert info.value.log_tail and info.value.details["action"] == "restore"
    assert (empty / "restore.log").exists()


@pytest.mark.criu
def test_placement_that_cannot_be_entered_is_a_clear_error(counters: Counters, criu_bin: Path, workdir: Path) -> None:
    pid = counters.spawn()
    away = criu.Placement(netns=str(workdir / "no-such-netns"))
    with pytest.raises(CriuError) as info:
        criu.dump(criu_bin, pid, workdir / "img", placement=away)
    assert "could not enter its namespaces or cgroups" in str(info.value)
    assert counters.value(pid) > 0  # never touched: the task keeps running


def _scramble(path: Path) -> None:
    """Flip every byte of an image after its magic: a damaged file CRIU reads late."""
    data = bytearray(path.read_bytes())
    for i in range(8, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.criu
def test_a_successful_run_logs_no_real_error(counters: Counters, criu_bin: Path, workdir: Path) -> None:
    pid = counters.spawn()
    run = criu.dump(criu_bin, pid, workdir / "img")
    text = run.log.read_text()
    assert "Error (" in text  # CRIU logs its harmless RLIMIT_NOFILE error on every run here ...
    assert criu.first_errors(run.log) == []  # ... which is not a real one


@pytest.mark.criu
def test_a_failed_restore_names_criu_first_real_error(counters: Counters, criu_bin: Path, workdir: Path) -> None:
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    (mm,) = images.glob("mm-*.img")
    _scramble(mm)
    with pytest.raises(CriuError) as info:
        criu.restore(criu_bin, images, pidfile=workdir / "x.pid", log_name="restore.log")
    err, log = info.value, images / "restore.log"
    errors = err.first_errors.splitlines()
    # the first real error is the task failing to read its memory image, not the
    # consequences at the log's end ("exited, status=1", "Restoring FAILED")
    real = [line for line in log.read_text().splitlines() if "Error (" in line and "RLIMIT_NOFILE" not in line]
    assert len(real) >= 2 and errors[0] in criu.first_errors(log)[:1]
    assert errors[0].startswith("task 1: ") and mm.name in errors[0]  # the damaged image, named
    assert errors[0].removeprefix("task 1: ").rsplit(" (", 1)[0] in real[0]
    assert "Restoring FAILED" not in errors[0] and "RLIMIT_NOFILE" not in err.first_errors
    assert errors[0] in err.message and str(log) in str(err)
    assert "criu's first errors" in str(err) and err.details["log"] == str(log)
    assert 1 <= len(errors) <= criu.FIRST_ERRORS
    # it survives the wire
    again = CriuError.from_dict(err.to_dict())
    assert again.first_errors == err.first_errors and str(again) == str(err)
    assert counters.value(pid) > 0  # the dumped task was never touched


def test_first_errors_of_a_missing_log_is_empty(tmp_path: Path) -> None:
    assert criu.first_errors(tmp_path / "no-such.log") == []


# The error lines of a real failed dump (a workspace holding a process traced by strace,
# CRIU 4.2.1): CRIU retries seizing the task and logs the same error each time.
TRACED_DUMP_LOG = """\
(00.000806) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.003108) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 17520 found, state S, err -1/10
(00.003412) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 17520 found, state S, err -1/10
(00.003719) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 17520 found, state S, err -1/10
(00.004025) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 17520 found, state S, err -1/10
(00.004330) Error (compel/src/lib/infect.c:262): Unseizable non-zombie 17520 found, state S, err -1/10
(00.004338) Error (criu/cr-dump.c:1975): Dumping FAILED.
"""


def test_a_repeated_error_is_shown_once(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(TRACED_DUMP_LOG)
    assert criu.first_errors(log) == [
        "Unseizable non-zombie 17520 found, state S, err -1/10 (compel/src/lib/infect.c:262)",
        "Dumping FAILED. (criu/cr-dump.c:1975)",
    ]
    assert criu.first_errors(log, limit=1) == [criu.first_errors(log)[0]]
