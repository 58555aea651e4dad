"""``restore_check.Watch``: the kernel's process events name what killed a process, also one
its parent reaped at once (on the host, with real processes)."""

from __future__ import annotations

import signal
import subprocess
import sys

from bunshin.runtime.criu import restore_check


def test_a_descendant_killed_by_a_signal_and_reaped_is_seen_and_a_normal_exit_is_not():
    watch = restore_check.Watch().start()
    try:
        # a child that forks a grandchild, which dies of SIGSEGV and is reaped at once, then exits 0
        code = ("import os, signal\n"
                "pid = os.fork()\n"
                "if pid == 0:\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
                "os.waitpid(pid, 0)\n")
        child = subprocess.Popen([sys.executable, "-c", code])
        assert child.wait(timeout=30) == 0
        assert watch.signals_under(child.pid) == [signal.SIGSEGV]
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
