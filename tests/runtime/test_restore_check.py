"""``restore_check.Watch``: the kernel's process events name what killed a process, also one
its parent reaped at once (on the host, with real processes); a clone whose ``proc`` is not
its procfs fails the check, its symlink never followed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bunshin.errors import RuntimeFailure
from bunshin.runtime.criu import restore_check


@pytest.mark.parametrize("thread", [True, False], ids=["thread", "socket-buffer"])
def test_a_descendant_killed_by_a_signal_and_reaped_is_seen_and_a_normal_exit_is_not(thread):
    """With a thread collecting the events, and without one (one restore): the events wait
    in the socket until the check reads them."""
    watch = restore_check.Watch().start(thread=thread)
    assert (watch._thread is not None) == thread
    try:
        # a child that forks a grandchild, which dies of SIGSEGV and is reaped at once, then exits 0
        code = ("import os, signal\n"
                "pid = os.fork()\n"
                "if pid == 0:\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
                "os.waitpid(pid, 0)\n")
        child = subprocess.Popen([sys.executable, "-c", code])
        assert child.wait(timeout=30) == 0
        assert watch.signals_under(child.pid) == [signal.SIGSEGV]
        assert watch.cpu_s > 0  # the thread's CPU, or the check's reading of the socket
        other = subprocess.Popen([sys.executable, "-c", "pass"])
        assert other.wait(timeout=30) == 0
        assert watch.signals_under(other.pid) == []
    finally:
        watch.close()


def test_a_closed_watch_collects_nothing_more_and_closes_at_once():
    watch = restore_check.Watch().start()
    watch.close()
    child = subprocess.Popen([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    child.wait(timeout=30)
    assert watch.signals_under(child.pid) == []


CHROOTED = "import os, sys, time\nos.chroot(sys.argv[1])\nos.chdir('/')\nprint('in', flush=True)\ntime.sleep(60)\n"


def test_a_clone_whose_proc_is_a_symlink_or_no_procfs_fails_the_check(tmp_path: Path) -> None:
    canary = tmp_path / "canary" / "1"  # a procfs of one running process, as a workspace could fake it
    canary.mkdir(parents=True)
    (canary / "stat").write_text("1 (canary) R 0 0 0\n")
    root = tmp_path / "root"  # the clone's root: a process chrooted there is its pid 1
    root.mkdir()
    (root / "proc").symlink_to(canary.parent)
    clone = subprocess.Popen([sys.executable, "-c", CHROOTED, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert clone.stdout is not None and clone.stdout.readline() == "in\n"
        assert os.readlink(f"/proc/{clone.pid}/root") == str(root)
        with pytest.raises(RuntimeFailure, match="clone c1: .* symlink or no folder: not followed"):
            restore_check._clone_proc("c1", clone.pid)
        (root / "proc").unlink()
        canary.parent.rename(root / "proc")
        with pytest.raises(RuntimeFailure, match="clone c1: .* no procfs"):
            restore_check._clone_proc("c1", clone.pid)
    finally:
        clone.kill()
        clone.wait()
    assert restore_check._clone_proc("c1", clone.pid) is None  # a clone gone: its processes are dead
    mine = restore_check._clone_proc("c0", os.getpid())  # a real one: read, a second thread too
    assert mine is not None
    done = threading.Event()
    second = threading.Thread(target=done.wait)
    second.start()
    try:
        assert second.native_id in restore_check._inside(mine)[os.getpid()]
    finally:
        done.set()
        second.join()
        os.close(mine)
