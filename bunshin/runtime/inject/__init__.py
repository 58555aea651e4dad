"""System calls issued in a live process from the host, with every thread stopped (ptrace).

``Stopped`` (``stopped``): the process stopped under the host's ptrace, its
seccomp filter suspended for the injected calls only; ``syscall`` runs one
from a ``syscall`` instruction the process already maps (``site``).
"""

from .ptrace import PtraceError
from .stopped import InjectionFailed, Stopped, check

__all__ = ["InjectionFailed", "PtraceError", "Stopped", "check"]
