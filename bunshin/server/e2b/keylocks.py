"""One lock per key (a sandbox or template id a client gave), kept only while held or awaited."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class KeyLocks:
    """Locks by key; a key's lock goes with its last holder or waiter, so keys a client
    makes up (any string) leave nothing behind."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}  # key -> its lock, callers holding or awaiting it

    @contextmanager
    def held(self, key: str) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key) or (threading.Lock(), 0)
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users = self._locks[key][1] - 1
                if users:
                    self._locks[key] = (lock, users)
                else:
                    del self._locks[key]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
