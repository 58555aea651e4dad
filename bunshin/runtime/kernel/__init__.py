"""Thin bindings to the kernel: raw syscalls (ctypes), /proc/self/mountinfo, the runtime's numeric
limits, what the host allows (host_limits), and the build of the small C helpers (cbuild).

May import: the standard library, bunshin.errors and bunshin.config only; no other room.
"""
