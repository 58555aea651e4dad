"""Threads started before the agent is forked, and a small event: lean call paths.

In a forked clone every page a call writes is copied from the snapshot into the clone,
and Python writes each object it touches (its reference count). Starting a
``threading.Thread`` per connection or job runs much of ``threading`` (and makes a
thread state, a stack and an arena); a ``Pool`` thread waiting on a ``SimpleQueue``
(C code) is woken instead. ``Flag`` is an event on one lock (``threading.Event`` runs a
``Condition`` in Python).
"""

from __future__ import annotations

import _thread
import sys
import threading
import traceback
from collections.abc import Callable
from queue import SimpleQueue
from typing import Any

#: Threads a pool starts ahead (a call uses two or three at once: its connection, its
#: job and the host's next poll) and keeps at most (busier moments start more, which
#: end once idle).
PRESTART = 4
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


class Pool:
    """Runs ``submit``ted calls on threads that wait for work."""

    def __init__(self, name: str, prestart: int = PRESTART, keep: int = KEEP) -> None:
        self._name = name
        self._queue: SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]]] = SimpleQueue()
        self._keep = keep
        self._prestart = prestart
        self._threads = 0
        self._idle = 0
        self._lock = _thread.allocate_lock()

    def start(self) -> None:
        """Start the threads that wait from now on (before the agent is snapshotted)."""
        for _ in range(self._prestart):
            self._spawn()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on an idle thread, or a new one. ``RuntimeError`` if no thread
        can be started (the workspace's pids limit)."""
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # taken: the next submit sees one fewer
        if start:
            self._spawn()
            with self._lock:
                self._idle -= 1
        self._queue.put((fn, args))

    def _spawn(self) -> None:
        with self._lock:
            self._threads += 1
            self._idle += 1
        try:
            threading.Thread(target=self._run, name=self._name, daemon=True).start()
        except BaseException:
            with self._lock:
                self._threads -= 1
                self._idle -= 1
            raise

    def _run(self) -> None:
        get = self._queue.get
        while True:
            fn, args = get()
            try:
                fn(*args)
            except BaseException:  # a call must not end its thread
                traceback.print_exc(file=sys.stderr)
            with self._lock:
                if self._threads > self._keep:
                    self._threads -= 1
                    return
                self._idle += 1
