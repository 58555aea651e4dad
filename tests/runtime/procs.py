"""Process helpers shared by the CRIU and memory-file tests."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def kill_and_wait(pid: int) -> None:
    """SIGKILL a process and wait until it is gone (reaping it if it is ours)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
        return
    except ChildProcessError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)


def fork_bomb(ws) -> tuple[object, int]:
    """Run a fork bomb in ``ws`` for 3 s; its exec result and the peak process count seen from the host."""
    import threading

    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], ws.stats().processes)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        r = ws.exec(["bash", "-c", "while :; do sleep 100 & done 2>/dev/null"], timeout=3)
    finally:
        stop.set()
        sampler.join()
    return r, peak[0]
