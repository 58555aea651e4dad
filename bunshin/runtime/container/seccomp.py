"""The seccomp filter every workspace process runs under.

A deny-list in the spirit of the container runtimes' default profiles, written as
classic BPF (no libseccomp: it is installed by the launcher between fork and exec,
where only plain syscalls are safe). It is inherited by every process of the
workspace and dumped and restored by CRIU with them (CRIU suspends it for its own
parasite code with ``PTRACE_O_SUSPEND_SECCOMP``).

Refused with ``EPERM``: the kernel keyring (``keyctl``, ``add_key``,
``request_key``: keys are otherwise reachable through a session keyring CRIU's
restore shares), new user namespaces (``unshare``/``clone`` with
``CLONE_NEWUSER``), ``ptrace``, ``process_vm_*``, ``prlimit64`` and ``pidfd_getfd``
aimed at pid 1 (the agent), mounts of any kind, ``setns``, ``bpf``,
``perf_event_open``, ``userfaultfd``, ``io_uring_*``, ``acct``, ``kexec_*``, module
loading, ``reboot``, ``swapon``/``swapoff``, ``syslog``, ``open_by_handle_at``,
``iopl``/``ioperm``, and every x32-ABI syscall. ``clone3`` gets ``ENOSYS`` (its
flags live in memory BPF cannot read), so libc falls back to ``clone``. A foreign
architecture is killed.

``socket``/``socketpair`` of the address families docker's default profile leaves out
get ``EAFNOSUPPORT`` (docker answers ``EPERM``; "not supported" is what a program that
probes for a family expects, and what a kernel without it says): ``AF_VSOCK`` (a VM's
channel to its hypervisor, outside every namespace), ``AF_ALG`` (the kernel's crypto
API, a frequent source of kernel bugs), the obsolete DECnet, Econet, ATM SVC, IrDA,
WAN pipe, ISDN and CAIF, and every family past the last one known (``AF_MCTP``, 45).
"""

from __future__ import annotations

import ctypes
import errno
import struct

from ..kernel import syscalls as sc

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
CLONE_NEWUSER = 0x10000000

# x86_64 syscall numbers refused outright.
DENIED = {
    "acct": 163, "add_key": 248, "bpf": 321, "delete_module": 176, "finit_module": 313,
    "fsconfig": 431, "fsmount": 432, "fsopen": 430, "fspick": 433, "init_module": 175,
    "io_uring_enter": 426, "io_uring_register": 427, "io_uring_setup": 425, "ioperm": 173,
    "iopl": 172, "kexec_file_load": 320, "kexec_load": 246, "keyctl": 250, "lookup_dcookie": 212,
    "mount": 165, "mount_setattr": 442, "move_mount": 429, "open_by_handle_at": 304,
    "open_tree": 428, "perf_event_open": 298, "pivot_root": 155, "reboot": 169,
    "request_key": 249, "setns": 308, "swapoff": 168, "swapon": 167, "syslog": 103,
    "umount2": 166, "userfaultfd": 323, "uselib": 134, "vhangup": 153,
}
CLONE, UNSHARE, CLONE3 = 56, 272, 435
SOCKET, SOCKETPAIR = 41, 53
# Address families refused (docker's default profile allows socket() for all others up
# to AF_MCTP): DECnet 12, Econet 19, ATMSVC 20, IrDA 23, WANPIPE 25, ISDN 34, CAIF 37,
# ALG 38, VSOCK 40; and every family from FIRST_UNKNOWN_FAMILY on.
DENIED_FAMILIES = {"AF_DECnet": 12, "AF_ECONET": 19, "AF_ATMSVC": 20, "AF_IRDA": 23, "AF_WANPIPE": 25,
                   "AF_ISDN": 34, "AF_CAIF": 37, "AF_ALG": 38, "AF_VSOCK": 40}
FIRST_UNKNOWN_FAMILY = 46
# Syscalls refused when the argument at index ``arg`` is pid 1.
AT_PID1 = {"ptrace": (101, 1), "process_vm_readv": (310, 0), "process_vm_writev": (311, 0),
           "prlimit64": (302, 0), "pidfd_open": (434, 0)}

# classic BPF
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
_NR, _ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


def _arg_hi(i: int) -> int:
    return 20 + 8 * i


class _Program:
    """A tiny assembler: jumps name labels, resolved to relative offsets at the end."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int | str, int | str, int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = b""
        for i, (code, jt, jf, k) in enumerate(self.code):
            def rel(j: int | str, i: int = i) -> int:
                if isinstance(j, str):
                    off = self.labels[j] - i - 1
                    if not 0 <= off < 256:
                        raise ValueError(f"seccomp jump to {j} out of range")
                    return off
                return j
            out += struct.pack("HBBI", code, rel(jt), rel(jf), k)
        return out


def program() -> bytes:
    """The filter as packed ``struct sock_filter`` entries."""
    p = _Program()
    p.op(_LD_W_ABS, _ARCH)
    p.op(_JEQ_K, AUDIT_ARCH_X86_64, 0, "kill")
    p.op(_LD_W_ABS, _NR)
    p.op(_JGE_K, X32_SYSCALL_BIT, "deny", 0)
    for nr in sorted(DENIED.values()):
        p.op(_JEQ_K, nr, "deny", 0)
    p.op(_JEQ_K, CLONE3, "enosys", 0)
    p.op(_JEQ_K, UNSHARE, "flags0", 0)
    p.op(_JEQ_K, CLONE, "flags0", 0)
    p.op(_JEQ_K, SOCKET, "family", 0)
    p.op(_JEQ_K, SOCKETPAIR, "family", 0)
    for name, (nr, _arg) in sorted(AT_PID1.items()):
        p.op(_JEQ_K, nr, f"pid1_{name}", 0)
    p.op(_RET_K, RET_ALLOW)
    p.label("flags0")  # unshare(flags) / clone(flags, ...): no CLONE_NEWUSER
    p.op(_LD_W_ABS, _arg_lo(0))
    p.op(_JSET_K, CLONE_NEWUSER, "deny", 0)
    p.op(_RET_K, RET_ALLOW)
    p.label("family")  # socket(family, ...) / socketpair(family, ...): the kernel reads an int
    p.op(_LD_W_ABS, _arg_lo(0))
    p.op(_JGE_K, FIRST_UNKNOWN_FAMILY, "eafnosupport", 0)
    for family in sorted(DENIED_FAMILIES.values()):
        p.op(_JEQ_K, family, "eafnosupport", 0)
    p.op(_RET_K, RET_ALLOW)
    for name, (_nr, arg) in sorted(AT_PID1.items()):
        p.label(f"pid1_{name}")
        p.op(_LD_W_ABS, _arg_lo(arg))
        p.op(_JEQ_K, 1, 0, "allow")
        p.op(_LD_W_ABS, _arg_hi(arg))
        p.op(_JEQ_K, 0, "deny", "allow")
    p.label("allow")
    p.op(_RET_K, RET_ALLOW)
    p.label("deny")
    p.op(_RET_K, RET_ERRNO | errno.EPERM)
    p.label("eafnosupport")
    p.op(_RET_K, RET_ERRNO | errno.EAFNOSUPPORT)
    p.label("enosys")
    p.op(_RET_K, RET_ERRNO | errno.ENOSYS)
    p.label("kill")
    p.op(_RET_K, RET_KILL_PROCESS)
    return p.assemble()


_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install() -> None:
    """Set no_new_privs and load the filter into the calling thread (inherited on fork)."""
    code = program()
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    sc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    sc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0)
