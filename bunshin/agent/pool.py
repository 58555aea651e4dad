"""Threads started before the agent is forked, and a small event: lean call paths.

In a forked clone every page a call writes is copied from the snapshot into the clone,
and Python writes each object it touches (its reference count). Starting a
``threading.Thread`` per connection or job runs much of ``threading`` (and makes a
thread state, a stack and an arena); a ``Pool`` thread waiting on a lock of its own is
woken instead. ``Flag`` is an event on one lock (``threading.Event`` runs a
``Condition`` in Python).
"""

from __future__ import annotations

import _thread
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

#: Threads a pool starts ahead and keeps at most (busier moments start more, which end once
#: idle). A call uses two at once, its connection's and its job's, and the host's first poll
#: can come before the first is idle again: three, so that a clone's calls never start one
#: (a thread started in a clone: ~200 KiB more). Each is two mappings (stack, guard) to dump.
PRESTART = 3
KEEP = 8


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


class _Worker:
    __slots__ = ("wake", "task")

    def __init__(self) -> None:
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.task: tuple[Callable[..., Any], tuple[Any, ...]] | None = None


class Pool:
    """Runs ``submit``ted calls on threads that wait for work, the one idle the shortest
    first: calls one after another run on the same one or two threads, whose stacks and
    malloc arenas a clone then copies, not those of every thread."""

    def __init__(self, name: str, prestart: int = PRESTART, keep: int = KEEP) -> None:
        self._name = name
        self._keep = keep
        self._prestart = prestart
        self._threads = 0
        self._idle: list[_Worker] = []  # a stack: the last one idle is woken first
        self._lock = _thread.allocate_lock()

    def start(self) -> None:
        """Start the threads that wait from now on (before the agent is snapshotted)."""
        for _ in range(self._prestart):
            self._spawn(None)

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread, or a new one. ``RuntimeError`` if no thread
        can be started (the workspace's pids limit)."""
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            self._spawn((fn, args))
            return
        worker.task = (fn, args)
        worker.wake.release()

    def _spawn(self, task: tuple[Callable[..., Any], tuple[Any, ...]] | None) -> None:
        worker = _Worker()
        with self._lock:
            self._threads += 1
        try:
            threading.Thread(target=self._run, args=(worker, task), name=self._name, daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
            raise

    def _run(self, worker: _Worker, task: tuple[Callable[..., Any], tuple[Any, ...]] | None) -> None:
        while True:
            if task is not None:
                fn, args = task
                task = None
                try:
                    fn(*args)
                except BaseException:  # a call must not end its thread
                    traceback.print_exc(file=sys.stderr)
                with self._lock:
                    if self._threads > self._keep:
                        self._threads -= 1
                        return
                    self._idle.append(worker)
            else:
                with self._lock:
                    self._idle.append(worker)
            worker.wake.acquire()
            task, worker.task = worker.task, None
