"""Threads that wait for calls, ended before each fork, and a small event: lean call paths.

In a forked clone every page a call writes is copied from the snapshot into the clone,
and Python writes each object it touches (its reference count). ``Pool`` starts its
threads with ``_thread`` itself: a ``threading.Thread`` runs much of ``threading`` (its
objects, an event, the registry of threads). A thread that served a call waits for the
next on a lock of its own (woken, it runs at once; a new thread per call made every
call slower, more so in a clone). Before each fork the host asks for ``trim``: every
thread of the agent is a task CRIU seizes and dumps (registers, signal mask, its
cgroups: a round trip to the parasite each) inside the pause, so the waiting ones end
first; a clone (and the parent) starts threads again at its first calls. A thread that
ends leaves its stack in glibc's cache and its malloc arena free, and the next one takes
both (the last freed first): a clone copies the pages of one or two stacks and arenas,
not those of every thread. ``Flag`` is an event on one lock (``threading.Event`` runs a
``Condition`` in Python).
"""

from __future__ import annotations

import _thread
import sys
import traceback
from collections.abc import Callable
from typing import Any


class Flag:
    """Set once, waited for by any number of threads."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        try:
            self._lock.release()
        except RuntimeError:  # set by two threads at once: released once already
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds (``None``: no limit)."""
        if self._set:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # the next waiter's turn
        return self._set


#: Threads a pool keeps waiting at most (busier moments start more, which end once idle).
KEEP = 8


class _Worker:
    __slots__ = ("wake", "task")

    def __init__(self) -> None:
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.task: tuple[Callable[..., Any], tuple[Any, ...]] | None = None


class Pool:
    """Runs ``submit``ted calls on threads that wait for work, the one idle the shortest
    first (its stack and arena are the ones a clone has copied already)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._threads = 0  # started and not ended: waiting or running a call
        self._idle: list[_Worker] = []  # a stack: the last one idle is woken first
        self._trimming = False  # from ``trim`` to the next ``submit``: a call's thread ends with it
        self._lock = _thread.allocate_lock()

    @property
    def threads(self) -> int:
        return self._threads

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread, or a new one. ``RuntimeError`` if no thread
        can be started (the workspace's pids limit)."""
        with self._lock:
            self._trimming = False
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            self._spawn((fn, args))
            return
        worker.task = (fn, args)
        worker.wake.release()

    def trim(self) -> int:
        """End every idle thread now, and each busy one when its call ends (until the next
        ``submit``). How many threads of the pool are left running calls."""
        with self._lock:
            self._trimming = True
            idle, self._idle = self._idle, []
            busy = self._threads - len(idle)
        for worker in idle:
            worker.wake.release()  # no task: it ends
        return busy

    def _spawn(self, task: tuple[Callable[..., Any], tuple[Any, ...]]) -> None:
        worker = _Worker()
        with self._lock:
            self._threads += 1
        try:
            _thread.start_new_thread(self._run, (worker, task))
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def _run(self, worker: _Worker, task: tuple[Callable[..., Any], tuple[Any, ...]] | None) -> None:
        while task is not None:
            fn, args = task
            task = None
            try:
                fn(*args)
            except BaseException:  # a call must not end its thread
                traceback.print_exc(file=sys.stderr)
            with self._lock:
                if self._trimming or self._threads > self._keep:
                    self._threads -= 1
                    return
                self._idle.append(worker)
            worker.wake.acquire()
            task, worker.task = worker.task, None
        with self._lock:  # woken without a task: trimmed
            self._threads -= 1
