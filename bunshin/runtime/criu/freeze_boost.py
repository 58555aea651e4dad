"""Real-time priority for the few milliseconds a dump keeps a workspace frozen.

On a busy machine every step of the pause waits for a CPU: criu's own work, the
namespace dumpers it forks, this process's notification handler, the copier of the
upper. Measured on this 2-core machine at load ~12 (forks of a running fork, 18 dumps
each, alternated): pause p50 60 ms with criu at normal priority, 21 ms with criu at
SCHED_FIFO; the mappings phase alone 28.7 -> 6.4 ms.

``Boost`` gives threads SCHED_FIFO at ``PRIORITY`` (below the kernel's own real-time
threads) until ``stop`` or until ``BUDGET_S`` has passed, whichever is first, then puts
back what they had. A dump whose pause is long (the first fork of a large heap) has
only its first ``BUDGET_S`` at that priority, so no dump keeps a core from the rest of
the machine for longer (and the kernel's real-time throttling leaves others 5 % anyway).
Threads a boosted one forks meanwhile (criu's namespace dumpers) inherit the priority
and end within milliseconds. Without CAP_SYS_NICE nothing is boosted.

The budget's timer is a thread of this process, started by ``arm`` before the dump:
``start`` (CRIU's ``pre-dump`` stage, just before the freeze) only wakes it. A thread
started there was still starting when CRIU's next notification came, the first inside
the pause, and held the GIL its answer needed: that round trip (``query-ext-files``, as
CRIU's log times it) p50 0.40 ms, p90 1.43 ms with the three threads a fork's dump used to
start at ``pre-dump`` against 0.12 / 0.33 ms with them started before (30 dumps each,
alternated in one process, load ~5).

A ``Boost`` with ``latency`` also holds a CPU latency request of 0 (``/dev/cpu_dma_latency``,
the kernel's PM QoS) for as long: an idle CPU then polls instead of halting. Each step of
the parasite's work is a round trip between criu and a frozen task on the other CPU, and
on this VM a halted vCPU is woken by an interrupt through the hypervisor: delta pause p50
14.7 -> 11.6 ms (10 dumps each, alternated, load ~1.5). The request goes with the
descriptor, also when this process dies.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Sequence

PRIORITY = 10
BUDGET_S = 0.05
LATENCY_DEVICE = "/dev/cpu_dma_latency"


def hold_latency(device: str = LATENCY_DEVICE) -> int:
    """A descriptor holding a CPU latency request of 0 (closing it ends it); -1 where the
    device is missing or refused."""
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        os.write(fd, struct.pack("i", 0))
    except OSError:
        os.close(fd)
        return -1
    return fd


class Boost:
    """SCHED_FIFO for the threads ``tids`` from ``start`` to ``stop`` (at most ``budget_s``);
    with ``latency``, idle CPUs polling meanwhile (``hold_latency``)."""

    def __init__(self, tids: Sequence[int], *, budget_s: float = BUDGET_S, latency: bool = False) -> None:
        self._tids = tuple(tids)
        self._budget_s = budget_s
        self._latency = latency
        self._latency_fd = -1
        self._saved: list[tuple[int, int, os.sched_param]] = []
        self._lock = threading.Lock()
        self._timer: threading.Thread | None = None
        self._go = threading.Event()  # set by start (the budget runs from then) or by stop
        self._ended = threading.Event()  # set by stop
        self._started = False

    def arm(self) -> None:
        """Start the budget's timer thread (idle until ``start``); call it before the dump."""
        with self._lock:
            if self._timer is None and not self._ended.is_set():
                self._timer = threading.Thread(target=self._budget, name="bunshin-boost-budget", daemon=True)
                self._timer.start()

    def _budget(self) -> None:
        self._go.wait()
        if not self._ended.wait(self._budget_s):
            self.stop()

    def start(self) -> None:
        """Boost every thread that is still there and may be boosted; the budget runs from now
        (its timer started here if ``arm`` was not called)."""
        with self._lock:
            if self._started or self._ended.is_set():
                return
            self._started = True
            if self._latency:
                self._latency_fd = hold_latency()
            for tid in self._tids:
                try:
                    saved = (tid, os.sched_getscheduler(tid), os.sched_getparam(tid))
                    os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(PRIORITY))
                except OSError:  # gone, or no CAP_SYS_NICE: it runs as it was
                    continue
                self._saved.append(saved)
        self.arm()
        self._go.set()

    def stop(self) -> None:
        """Put back each boosted thread's policy and end the timer (idempotent; also when the
        budget ends). A boost stopped is not started again."""
        with self._lock:
            self._ended.set()
            self._go.set()
            if self._latency_fd >= 0:
                os.close(self._latency_fd)
                self._latency_fd = -1
            for tid, policy, param in self._saved:
                with contextlib.suppress(OSError):  # ended meanwhile
                    os.sched_setscheduler(tid, policy, param)
            self._saved = []

    @property
    def holds_latency(self) -> bool:
        """Whether the CPU latency request is held now."""
        with self._lock:
            return self._latency_fd >= 0

    @property
    def boosted(self) -> tuple[int, ...]:
        """The threads at real-time priority now."""
        with self._lock:
            return tuple(tid for tid, _, _ in self._saved)
