"""System calls injected into a live process of a real workspace (ptrace from the host)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.runtime.inject import InjectionFailed, Stopped, check
from bunshin.runtime.inject.site import syscall_site

NR_CLOSE, NR_GETPID, NR_USERFAULTFD, NR_GETTID = 3, 39, 323, 186
UFFD_USER_MODE_ONLY, O_CLOEXEC = 1, 0o2000000

# Two threads (one blocked in a long sleep), a count file the main thread keeps
# writing, and a SIGUSR1 handler that counts the signals it gets.
PROG = r"""
import os, signal, threading, time
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
threading.Thread(target=lambda: time.sleep(10_000), daemon=True).start()
i = 0
while True:
    i += 1
    with open("/tmp/count.tmp", "w") as f:
        f.write(f"{i} {len(got)}")
    os.replace("/tmp/count.tmp", "/tmp/count")
    time.sleep(0.02)
"""


def host_pid(ws, pid: int, timeout: float = 20) -> int:
    """The host pid of the process ``pid`` of ``ws``'s pid namespace."""
    deadline = time.monotonic() + timeout
    ns = os.readlink(f"/proc/{ws.record.pid}/ns/pid")
    while time.monotonic() < deadline:
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                if os.readlink(p / "ns/pid") != ns:
                    continue
                nspid = next(ln for ln in (p / "status").read_text().splitlines() if ln.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            if int(nspid.split()[-1]) == pid:
                return int(p.name)
        time.sleep(0.05)
    raise AssertionError(f"no host process for pid {pid} of {ws.id}")


def counts(ws) -> tuple[int, int]:
    for _ in range(200):
        text = ws.files.read_text("/tmp/count").split()
        if len(text) == 2:
            return int(text[0]), int(text[1])
        time.sleep(0.01)
    raise AssertionError("no count")


def started(family) -> tuple[object, int, int]:
    ws = family.create()
    pid = ws.commands.spawn(["python3", "-c", PROG])
    hp = host_pid(ws, pid)
    while not ws.files.list("/tmp") or "count" not in {e.name for e in ws.files.list("/tmp")}:
        time.sleep(0.02)
    while len(os.listdir(f"/proc/{hp}/task")) < 2:
        time.sleep(0.02)
    return ws, pid, hp


def test_injected_calls_run_in_the_process_and_it_carries_on(family) -> None:
    ws, pid, hp = started(family)
    with Stopped(hp) as s:
        assert set(s.threads) == {int(t) for t in os.listdir(f"/proc/{hp}/task")}
        states = {Path(f"/proc/{hp}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] for t in s.threads}
        assert states == {"t"}  # every thread in a tracing stop
        before = counts(ws)
        assert s.syscall(NR_GETPID) == pid  # its own namespace's view: it ran in the process
        assert s.syscall(NR_GETTID) == pid
        assert s.syscall(NR_CLOSE, 9999) == -errno.EBADF
        time.sleep(0.2)
        assert counts(ws) == before  # stopped: it wrote nothing meanwhile
    time.sleep(0.3)
    after = counts(ws)
    assert after[0] > before[0] + 3  # running again: the main thread left its sleep as it would
    assert "TracerPid:\t0" in Path(f"/proc/{hp}/status").read_text()
    assert len(os.listdir(f"/proc/{hp}/task")) == 2  # the sleeping thread is still there


def test_seccomp_is_suspended_for_the_injected_call_only(family) -> None:
    """The workspace's filter refuses userfaultfd; the host's injected one runs, the process never holds it."""
    ws, pid, hp = started(family)
    probe = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "print(libc.syscall(323, 1 | 0o2000000), ctypes.get_errno(), libc.syscall(323, 0o2000000), ctypes.get_errno())")
    r = ws.exec(["python3", "-c", probe])
    assert r.stdout.split() == ["-1", str(errno.EPERM), "-1", str(errno.EPERM)], r
    with Stopped(hp) as s:
        fd = check(s.syscall(NR_USERFAULTFD, UFFD_USER_MODE_ONLY | O_CLOEXEC), "userfaultfd")
        assert os.readlink(f"/proc/{hp}/fd/{fd}") == "anon_inode:[userfaultfd]"
        assert s.syscall(NR_CLOSE, fd) == 0
    assert not any("userfaultfd" in os.readlink(f"/proc/{hp}/fd/{f}") for f in os.listdir(f"/proc/{hp}/fd"))
    r = ws.exec(["python3", "-c", probe])  # still refused to the workspace afterwards
    assert r.stdout.split() == ["-1", str(errno.EPERM), "-1", str(errno.EPERM)], r


def test_a_signal_sent_while_stopped_is_delivered_once_after(family) -> None:
    ws, pid, hp = started(family)
    with Stopped(hp) as s:
        os.kill(hp, signal.SIGUSR1)
        time.sleep(0.05)
        assert s.syscall(NR_GETPID) == pid  # the signal came first: kept, the call retried
        assert counts(ws)[1] == 0
    deadline = time.monotonic() + 10
    while counts(ws)[1] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    assert counts(ws)[1] == 1


def test_refusals(family) -> None:
    ws, pid, hp = started(family)
    with pytest.raises(InjectionFailed, match="gone"):
        Stopped(2**22 + 12345).__enter__()
    with Stopped(hp) as s:
        with pytest.raises(InjectionFailed, match="userfaultfd failed in the process"):
            check(s.syscall(NR_USERFAULTFD, 0), "userfaultfd")  # not user-mode only: needs privilege it lacks
        with pytest.raises(ValueError):
            s.syscall(NR_GETPID, 1, 2, 3, 4, 5, 6, 7)
        assert syscall_site(hp) > 0
    with pytest.raises(InjectionFailed, match="not stopped"):
        s.syscall(NR_GETPID)
    before = counts(ws)[0]
    time.sleep(0.2)
    assert counts(ws)[0] > before  # every refusal left it running


def test_a_pid_reused_by_another_process_is_refused(family) -> None:
    """The process meant (its pidfd) died; its pid now names another (here: the workspace's program,
    standing in for a host process): nothing is injected, the other is released untouched."""
    ws, pid, hp = started(family)
    gone = subprocess.Popen(["true"])
    pidfd = os.pidfd_open(gone.pid)
    gone.wait()
    with pytest.raises(InjectionFailed, match="another process"):
        with Stopped(hp, pidfd=pidfd):
            raise AssertionError("must not be reached")
    os.close(pidfd)
    assert "TracerPid:\t0" in Path(f"/proc/{hp}/status").read_text()
    before = counts(ws)[0]
    time.sleep(0.2)
    assert counts(ws)[0] > before  # running on
