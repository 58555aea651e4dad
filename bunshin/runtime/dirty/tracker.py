"""Which pages a live process writes, from the host: userfaultfd write-protect (async) and ``PAGEMAP_SCAN``.

``Tracker.open(pid)`` injects one ``userfaultfd(UFFD_USER_MODE_ONLY)`` into the
stopped process (``inject.Stopped``: its seccomp filter is suspended for that
call only, never opened; a user-mode-only uffd needs no privilege), takes a
copy of the fd with ``pidfd_getfd`` and closes the process's own (CRIU cannot
dump a uffd, and the process never gets to use it). Every later ioctl acts on
the process's mm from the host (the uffd holds it): ``track`` registers areas
for write-protect faults in async mode (the kernel clears the protection on a
write and notes it; nothing waits on the host) and protects them;
``written`` reports the runs written since and protects them again in the same
walk. Protection is a page-table bit, not a copy: the process runs at full
speed but for one minor fault per first write of a page. ``close`` unregisters
everything (the areas are as before) and drops the fds.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from bunshin.runtime.inject import InjectionFailed, Stopped, check

from . import kernel
from .kernel import Run


class TrackingUnavailable(Exception):
    """The process's writes cannot be tracked (the reason is the message)."""


@dataclass(frozen=True)
class Area:
    start: int
    end: int


class Tracker:
    """Write tracking of one process's areas; see the module doc. A context manager."""

    def __init__(self, pid: int, uffd: int, pagemap: int) -> None:
        self.pid = pid
        self._uffd, self._pagemap = uffd, pagemap
        self.areas: list[Area] = []

    @classmethod
    def open(cls, pid: int, proc: Path = Path("/proc"), stopped: Stopped | None = None,
             pidfd: int | None = None) -> Tracker:
        """A tracker of ``pid`` (its threads stopped for the two injected calls, unless ``stopped`` holds them)."""
        try:
            if stopped is None:
                with Stopped(pid, proc, pidfd=pidfd) as s:
                    uffd = cls._make(s)
            else:
                uffd = cls._make(stopped)
        except InjectionFailed as exc:
            raise TrackingUnavailable(str(exc)) from None
        try:
            kernel.api(uffd)
            pagemap = os.open(proc / str(pid) / "pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            os.close(uffd)
            raise TrackingUnavailable(f"asynchronous write-protect tracking is not available: {exc.strerror}") from None
        if pidfd is not None:  # alive after the open: the pid was still its, the descriptor is its pagemap
            try:
                signal.pidfd_send_signal(pidfd, 0)
            except ProcessLookupError:
                os.close(uffd)
                os.close(pagemap)
                raise TrackingUnavailable(f"process {pid} exited (its pid may be another process's now)") from None
        return cls(pid, uffd, pagemap)

    @staticmethod
    def _make(s: Stopped) -> int:
        fd = check(s.syscall(kernel.NR_USERFAULTFD, kernel.UFFD_USER_MODE_ONLY | kernel.O_CLOEXEC | kernel.O_NONBLOCK),
                   "userfaultfd")
        try:
            return kernel.pidfd_getfd(s.pid, fd)
        except OSError as exc:
            raise InjectionFailed(f"cannot take the process's userfaultfd: {exc.strerror}") from None
        finally:
            check(s.syscall(kernel.NR_CLOSE, fd), "close of the injected userfaultfd")

    def track(self, start: int, end: int) -> None:
        """Register ``[start, end)`` (one or more whole private anonymous areas) and protect it."""
        try:
            kernel.register_wp(self._uffd, start, end - start)
        except OSError as exc:
            raise TrackingUnavailable(f"area {start:#x}-{end:#x} cannot be tracked: {exc.strerror}") from None
        self.areas.append(Area(start, end))
        kernel.write_protect(self._uffd, start, end - start)

    def written(self, area: Area, *, protect: bool = True) -> list[Run] | None:
        """The runs of ``area`` written since the last call (``None``: no longer tracked whole, e.g. moved).

        Exact when the process is stopped; while it runs, a change after the
        call shows in the next one.
        """
        try:
            runs = kernel.scan_written(self._pagemap, area.start, area.end, protect=protect)
            return runs if kernel.wp_covered(self._pagemap, area.start, area.end) else None
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EINVAL, errno.ENOENT, errno.EFAULT):
                return None  # unmapped, remapped or changed since it was registered
            raise

    def populated(self, start: int, end: int) -> list[Run]:
        """The runs of ``[start, end)`` that hold pages (the rest reads as zeros)."""
        return kernel.scan_populated(self._pagemap, start, end)

    def present(self, start: int, end: int) -> list[Run]:
        """The runs of ``[start, end)`` in memory, the shared zero page left out."""
        return kernel.scan_present(self._pagemap, start, end)

    def swapped(self, start: int, end: int) -> list[Run]:
        """The runs of ``[start, end)`` swapped out or never touched since tracked (markers)."""
        return kernel.scan_swapped(self._pagemap, start, end)

    def close(self) -> None:
        """Stop tracking: every area unregistered (what is still mapped), the fds closed."""
        if self._uffd < 0:
            return
        for a in self.areas:
            try:
                kernel.unregister(self._uffd, a.start, a.end - a.start)
            except OSError:
                pass  # gone or changed: the kernel dropped its registration with it
        self.areas.clear()
        os.close(self._uffd)
        os.close(self._pagemap)
        self._uffd = self._pagemap = -1

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
