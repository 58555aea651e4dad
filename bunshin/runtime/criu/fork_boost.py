"""A larger CPU share for the host's threads that pre-copy a first fork, for as long as that takes.

The live pre-copy (``runtime.precopy``) is CPU work on the host's side: its copying
threads, the stops and remaps it drives, the helpers it forks. On two cores shared with
other work that time is handed out by weight, and with the kernel's autogroups every
other session (every other engineer's shell, a busy loop started with ``setsid``) weighs
as much as the whole bunshin process: the copying threads' own nice (``vmcopy.NICE``)
only counts against threads of the same session. Measured beside two busy loops in
sessions of their own, 4 GiB: usable 6.3 s, of it 4.6 s the first pre-copy pass and 7.9 s
of run-queue wait summed over the threads, against 2.3 s with the process in a CPU cgroup
weighing 8 times the default (the README's *Beside other work*).

``boosted`` moves the calling thread into a CPU cgroup of its own, a child of the thread's
own v1 CPU cgroup (``fork-boost.bunshin.<pid>.<tid>``, ``cpu.shares`` = ``factor`` x 1024);
threads and processes it starts meanwhile inherit it. Here bunshin runs at the hierarchy's
top, so it weighs against every session and workspace; run in a service's cgroup it weighs
only against its siblings there, and the service's own limits still hold. On leaving, or after ``BUDGET_S`` whichever is
first, every task in it goes back to the thread's own cgroup (where the kernel's autogroup
applies again) and the cgroup is removed. A machine-wide choice: for those seconds the
fork's host threads weigh ``factor`` sessions. Nothing of the workspace is ever in it (its
processes stay in their own cgroups; the host's tasks are only the caller's threads and
children), and nothing inside a workspace can write the host's cgroup files.

``BUNSHIN_FORK_CPU_BOOST`` sets the factor (1 or 0: off); a malformed value is refused.
Where there is no v1 CPU hierarchy (cgroup v2 moves whole processes, not threads), or a
write is refused, nothing is boosted and the fork goes on as before.

CRIU's dump is never run in it: a v1 child cgroup has no real-time budget
(``cpu.rt_runtime_us`` 0), and ``freeze_boost`` gives the dump SCHED_FIFO.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from ..container.cgroups import Layout
from ..kernel.limits import env_factor

ENV = "BUNSHIN_FORK_CPU_BOOST"
FACTOR = 8
DEFAULT_SHARES = 1024
MAX_SHARES = 262144
BUDGET_S = 20.0  # the longest a fork's threads keep the larger weight
PREFIX = "fork-boost.bunshin."  # (not a workspace's cgroup_prefix: gc never takes it for one)


def factor() -> int:
    """The boost factor from ``ENV`` (default ``FACTOR``); 1 means none."""
    return env_factor(ENV, FACTOR, "fork")


def cpu_root() -> Path | None:
    """The mount point of the v1 hierarchy holding the CPU controller; None without one."""
    try:
        layout = Layout.discover()
    except Exception:  # noqa: BLE001 (no cgroups: nothing to boost)
        return None
    if layout.version != 1:
        return None
    for h in layout.hierarchies:
        if "cpu" in h.controllers:
            return h.mountpoint
    return None


def thread_cgroup(tid: int) -> str | None:
    """Thread ``tid``'s (of this process) v1 CPU cgroup, relative to the hierarchy ('/' its top)."""
    try:
        text = Path(f"/proc/self/task/{tid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            return path
    return None


class Boost:
    """One boost: its cgroup, where its tasks go back to, and its end (``close``, or its budget's
    timer: once, whichever is first)."""

    def __init__(self, root: Path, origin: Path, path: Path) -> None:
        self.root, self.origin, self.path = root, origin, path
        self._lock = threading.Lock()
        self.ended = False
        self.timed_out = False
        self.timer: threading.Timer | None = None

    def close(self) -> None:
        """End it now (its budget's timer stopped)."""
        if self.timer is not None:
            self.timer.cancel()
        self.end()

    def end(self, *, timed_out: bool = False) -> None:
        """Every task of the cgroup back to ``origin``, the cgroup removed (a task that just
        exited may still be listed: a few tries)."""
        with self._lock:
            if self.ended:
                return
            self.ended, self.timed_out = True, timed_out
            for _ in range(50):
                for tid in _tasks(self.path):
                    with contextlib.suppress(OSError):  # (gone meanwhile)
                        (self.origin / "tasks").write_text(str(tid))
                try:
                    os.rmdir(self.path)
                    return
                except FileNotFoundError:
                    return
                except OSError:
                    threading.Event().wait(0.01)


def _tasks(path: Path) -> list[int]:
    try:
        return [int(t) for t in (path / "tasks").read_text().split()]
    except OSError:
        return []


def _sweep(root: Path) -> None:
    """Remove boost cgroups a process that died left (empty: their threads died with it)."""
    try:
        names = [e.name for e in os.scandir(root) if e.name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(PREFIX).split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                os.rmdir(root / name)


def start(by: int, budget_s: float = BUDGET_S) -> Boost | None:
    """Move the calling thread into a new boost cgroup weighing ``by`` times the default, for at
    most ``budget_s`` (``Boost.close`` ends it sooner); None where it was not (factor 1, no v1 CPU
    hierarchy, a write refused: it runs as it was)."""
    root = cpu_root() if by > 1 else None
    tid = threading.get_native_id()
    own = thread_cgroup(tid) if root is not None else None
    if root is None or own is None:
        return None
    origin = root / own.lstrip("/")
    _sweep(origin)
    path = origin / f"{PREFIX}{os.getpid()}.{tid}"  # beneath its own: whatever bounds the host set there still hold
    with contextlib.suppress(OSError):
        os.rmdir(path)  # an empty one left by a process that had this pid (held: not empty, refused below)
    try:
        path.mkdir()
    except OSError:
        return None  # (this thread holds one already: it runs as it is)
    boost = Boost(root, origin, path)
    try:
        (path / "cpu.shares").write_text(str(min(DEFAULT_SHARES * by, MAX_SHARES)))
        boost.timer = threading.Timer(budget_s, lambda: boost.end(timed_out=True))
        boost.timer.daemon = True
        boost.timer.start()  # (before the move: its thread stays where it is)
        (path / "tasks").write_text(str(tid))
    except OSError:
        boost.close()
        return None
    return boost


@contextlib.contextmanager
def boosted(by: int | None = None, *, budget_s: float = BUDGET_S) -> Iterator[Boost | None]:
    """The calling thread (and what it starts) at ``by`` (default ``factor()``) times the
    default CPU weight inside the block, at most ``budget_s``; then as before, also on failure."""
    boost = start(factor() if by is None else by, budget_s)
    try:
        yield boost
    finally:
        if boost is not None:
            boost.close()
