"""Stop every thread of a live process and issue system calls in it from the host.

``Stopped(pid)`` seizes each thread (``PTRACE_SEIZE`` with
``PTRACE_O_SUSPEND_SECCOMP``, as CRIU does for its parasite: the workspace's
filter is never opened for us; the call runs with the process's own creds),
interrupts it and waits until all are stopped; threads created meanwhile are
seized too, until the set is stable (a stopped thread cannot clone). A thread
found delivering a signal is let take it first (its handler's frame is set up,
as compel's seize does) until the interrupt stops it, so none is held with a
signal to give back.
With ``pidfd`` (opened when the process was chosen), a pid reused by
another process since is refused once its threads are held.
``syscall(nr, *args)`` saves the leader's registers, points ``rip`` at a
``syscall`` instruction the process already maps (``site``), resumes it to the
call's entry and exit stops (``PTRACE_SYSCALL``: a single step would force a SIGTRAP
that unblocks it, visibly) and restores the registers (a call the thread was blocked in restarts as it would
after any signal). A signal that arrives before the call runs is kept with its
``siginfo`` and given back, as it was, at the detach. The host process must stay in one thread for all of it.
"""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from types import TracebackType

from . import ptrace
from .site import NoSite, syscall_site

_MAX_ERRNO = 4095
_MAX_SIGNALS = 64


class InjectionFailed(Exception):
    """A call could not be injected (the reason is the message); the process is left as it was."""


class Stopped:
    """All threads of ``pid`` stopped under the host's ptrace; see the module doc."""

    def __init__(self, pid: int, proc: Path = Path("/proc"), *, pidfd: int | None = None) -> None:
        self.pid = pid
        self._proc = proc
        self._pidfd = pidfd  # the process meant: once its threads are held, it must still be alive
        self._held: dict[int, int] = {}  # tid -> signal to give back on detach
        self._info: dict[int, bytes] = {}  # tid -> that signal's siginfo
        self._site: int | None = None
        self._more: list[tuple[int, int]] = []

    def __enter__(self) -> Stopped:
        try:
            self._stop_all()
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._release()

    @property
    def threads(self) -> tuple[int, ...]:
        return tuple(sorted(self._held))

    def _tids(self) -> set[int]:
        try:
            return {int(t) for t in os.listdir(self._proc / str(self.pid) / "task")}
        except FileNotFoundError:
            raise InjectionFailed(f"process {self.pid} is gone") from None

    def _stop_all(self) -> None:
        while True:
            new = self._tids() - set(self._held)
            if not new:
                break
            for tid in sorted(new):
                try:
                    ptrace.seize(tid)
                except ptrace.PtraceError as exc:
                    if exc.errno == errno.ESRCH:
                        continue  # exited between the listing and the seize
                    raise InjectionFailed(f"cannot trace thread {tid}: {exc.strerror}") from None
                self._held[tid] = 0
                ptrace.interrupt(tid)
                stop = ptrace.wait(tid)
                for _ in range(_MAX_SIGNALS):  # delivering a signal: let it take it; the interrupt stops it next
                    if stop.exited or not stop.signal:
                        break
                    ptrace.cont(tid, stop.signal)
                    stop = ptrace.wait(tid)
                if stop.exited:
                    del self._held[tid]
                    continue
                if stop.signal:
                    raise InjectionFailed(f"signals keep arriving: thread {tid} does not stop")
        if self.pid not in self._held:
            raise InjectionFailed(f"process {self.pid} exited while being stopped")
        if self._pidfd is not None:  # held now, its pid cannot be reused: is it still the one meant?
            try:
                signal.pidfd_send_signal(self._pidfd, 0)
            except ProcessLookupError:
                raise InjectionFailed(f"process {self.pid} exited (its pid is another process's now)") from None

    def _keep(self, tid: int, sig: int) -> None:
        if not self._held.get(tid):
            self._held[tid] = sig
            try:
                self._info[tid] = ptrace.get_siginfo(tid)
            except ptrace.PtraceError:
                self._info.pop(tid, None)
        elif self._held[tid] != sig:
            self._more.append((tid, sig))  # a second signal: sent again after the detach

    def _release(self) -> None:
        for tid, sig in self._held.items():
            try:
                if sig and tid in self._info:  # (stopped in a step's SIGTRAP: made the kept signal again)
                    ptrace.set_siginfo(tid, self._info[tid])
                ptrace.detach(tid, sig)
            except ptrace.PtraceError:
                pass  # exited (or killed) meanwhile
        self._held.clear()
        self._info.clear()
        for tid, sig in self._more:
            ptrace.tgkill(self.pid, tid, sig)
        self._more.clear()

    def syscall(self, nr: int, *args: int, tid: int | None = None) -> int:
        """Issue system call ``nr`` in the leader (or thread ``tid``); its result (a negative errno on failure)."""
        if len(args) > 6:
            raise ValueError("a system call takes at most six arguments")
        tid = self.pid if tid is None else tid
        if tid not in self._held:
            raise InjectionFailed(f"thread {tid} of process {self.pid} is not stopped")
        if self._site is None:
            try:
                self._site = syscall_site(self.pid, self._proc)
            except (NoSite, OSError) as exc:
                raise InjectionFailed(str(exc)) from None
        saved = ptrace.get_regs(tid)
        regs = saved.copy()
        regs.rax, regs.orig_rax, regs.rip = nr, (1 << 64) - 1, self._site  # orig_rax -1: no restart
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args, strict=False):
            setattr(regs, name, value & ((1 << 64) - 1))
        try:
            ptrace.set_regs(tid, regs)
            stops = 0  # the call's entry, then its exit
            for _ in range(_MAX_SIGNALS):
                ptrace.to_syscall_stop(tid)
                stop = ptrace.wait(tid)
                if stop.exited:
                    del self._held[tid]
                    raise InjectionFailed(f"process {self.pid} died during an injected system call {nr}")
                if stop.signal == ptrace.SYSCALL_STOP:
                    stops += 1
                    if stops == 2:
                        break
                    continue
                # a signal arrived: kept for the detach, not delivered
                self._keep(tid, stop.signal)
            else:
                raise InjectionFailed(f"signals keep arriving: the system call {nr} was not injected")
            after = ptrace.get_regs(tid)
            if after.rip != self._site + 2:
                raise InjectionFailed(f"the injected system call {nr} did not return to its site")
            res = int(after.rax)
        finally:
            if tid in self._held:
                ptrace.set_regs(tid, saved)
        return res - (1 << 64) if res > (1 << 64) - _MAX_ERRNO - 1 else res


def check(res: int, what: str) -> int:
    """``res`` of an injected call, or InjectionFailed naming ``what`` and its errno."""
    if res < 0:
        raise InjectionFailed(f"{what} failed in the process: {os.strerror(-res)}")
    return res
