"""Raw ptrace for x86_64 through ctypes: seize, interrupt, wait, registers, single-step, detach.

Every call of one traced process must come from the same host thread (the
kernel's tracer is a thread, not a process).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

PTRACE_CONT, PTRACE_GETREGS, PTRACE_SETREGS = 7, 12, 13
PTRACE_SYSCALL, PTRACE_DETACH = 24, 17
PTRACE_GETSIGINFO, PTRACE_SETSIGINFO = 0x4202, 0x4203
SIGINFO_SIZE = 128
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_O_TRACESYSGOOD = 1
PTRACE_O_EXITKILL = 1 << 20
SYSCALL_STOP = 0x80 | 5  # SIGTRAP | 0x80: a syscall-enter or -exit stop (TRACESYSGOOD)
PTRACE_O_SUSPEND_SECCOMP = 1 << 21
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
SIGTRAP, SIGSTOP = 5, 19

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)


class Regs(ctypes.Structure):
    """``struct user_regs_struct`` of x86_64."""

    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx",
        "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base",
        "ds", "es", "fs", "gs")]

    def copy(self) -> Regs:
        out = Regs()
        ctypes.pointer(out)[0] = self
        return out


class PtraceError(OSError):
    """A ptrace request failed (``errno`` says why)."""


def _call(request: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p | None = 0) -> int:
    ctypes.set_errno(0)
    res = _libc.ptrace(request, tid, ctypes.c_void_p(addr), data)
    err = ctypes.get_errno()
    if res == -1 and err:
        raise PtraceError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")
    return int(res)


def seize(tid: int) -> None:
    """Trace ``tid`` without stopping it; seccomp stays suspended for it while traced."""
    _call(PTRACE_SEIZE, tid, 0, ctypes.c_void_p(PTRACE_O_SUSPEND_SECCOMP | PTRACE_O_EXITKILL | PTRACE_O_TRACESYSGOOD))


def interrupt(tid: int) -> None:
    _call(PTRACE_INTERRUPT, tid)


def detach(tid: int, sig: int = 0) -> None:
    _call(PTRACE_DETACH, tid, 0, ctypes.c_void_p(sig))


def cont(tid: int, sig: int = 0) -> None:
    """Resume ``tid``, delivering ``sig`` (a signal-delivery stop's own, to let it be taken)."""
    _call(PTRACE_CONT, tid, 0, ctypes.c_void_p(sig))


def get_siginfo(tid: int) -> bytes:
    """The ``siginfo_t`` of the signal ``tid`` is stopped delivering."""
    buf = ctypes.create_string_buffer(SIGINFO_SIZE)
    _call(PTRACE_GETSIGINFO, tid, 0, ctypes.cast(buf, ctypes.c_void_p))
    return buf.raw


def set_siginfo(tid: int, info: bytes) -> None:
    """Make ``info`` the signal ``tid`` is stopped delivering (a detach with its number then
    delivers it as it was, not as a new ``SI_USER`` signal)."""
    buf = ctypes.create_string_buffer(info, SIGINFO_SIZE)
    _call(PTRACE_SETSIGINFO, tid, 0, ctypes.cast(buf, ctypes.c_void_p))


def tgkill(pid: int, tid: int, sig: int) -> None:
    """Send ``sig`` to one thread (gone already: nothing to do)."""
    _libc.syscall.restype = ctypes.c_long
    _libc.syscall(234, pid, tid, sig)


def to_syscall_stop(tid: int) -> None:
    """Resume ``tid`` to its next syscall-enter or -exit stop (no signal is delivered).

    Not a single step: a step's trap is a forced SIGTRAP (``force_sig_fault``), which takes
    SIGTRAP out of the thread's blocked set and resets an ignored or blocked SIGTRAP's
    action to the default, where the program would see it; a syscall stop changes neither.
    """
    _call(PTRACE_SYSCALL, tid, 0, ctypes.c_void_p(0))


def get_regs(tid: int) -> Regs:
    regs = Regs()
    _call(PTRACE_GETREGS, tid, 0, ctypes.cast(ctypes.pointer(regs), ctypes.c_void_p))
    return regs


def set_regs(tid: int, regs: Regs) -> None:
    _call(PTRACE_SETREGS, tid, 0, ctypes.cast(ctypes.pointer(regs), ctypes.c_void_p))


@dataclass(frozen=True)
class Stop:
    """How a traced thread stopped: ``signal`` is the pending signal of a signal-delivery stop."""

    exited: bool
    signal: int = 0  # 0: a ptrace event stop (PTRACE_INTERRUPT), no signal pending
    event: int = 0


def wait(tid: int) -> Stop:
    """Wait for the next stop (or exit) of ``tid``."""
    while True:
        try:
            _, status = os.waitpid(tid, WALL)
        except InterruptedError:
            continue
        except ChildProcessError as exc:
            raise PtraceError(errno.ECHILD, f"thread {tid} is not traced by this thread") from exc
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            return Stop(exited=True)
        if os.WIFSTOPPED(status):
            sig, event = os.WSTOPSIG(status), status >> 16
            if event == PTRACE_EVENT_STOP:
                return Stop(exited=False, event=event)
            if event:
                return Stop(exited=False, event=event)
            return Stop(exited=False, signal=sig)
