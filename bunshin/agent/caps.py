"""The capabilities the agent drops from its children, and the one it keeps for itself."""

from __future__ import annotations

# Dropped from the bounding set of every child before exec, and of pid 1 (by the
# launcher) but for PID1_ONLY_CAP. Nothing inside has CAP_SYS_PTRACE.
DROPPED_CAPS = {
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_NET_ADMIN": 12,
    "CAP_NET_RAW": 13,
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_SYS_BOOT": 22,
    "CAP_SYS_TIME": 25,
    "CAP_MKNOD": 27,
    "CAP_AUDIT_CONTROL": 30,
    "CAP_MAC_OVERRIDE": 32,
    "CAP_MAC_ADMIN": 33,
    "CAP_SYSLOG": 34,
    "CAP_AUDIT_READ": 37,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
}
# Kept by pid 1 alone. It confers nothing in a user namespace (module loading is
# checked against the host's), but the kernel lets a process ptrace, or open
# /proc/1/{mem,environ,fd}, only if the target's permitted capabilities are a subset
# of its own (or with CAP_SYS_PTRACE): so nothing inside can reach the agent. Making
# pid 1 non-dumpable instead cannot be combined with CRIU: a restored task's memory
# belongs to the host's user namespace (it never execs), and CRIU's check that a
# clone's namespaces belong to its user namespace then fails when it dumps the
# clone ("Can't open PID/ns/uts on procfs: Permission denied ... One or more
# namespaces doesn't belong to the target user namespace").
PID1_ONLY_CAP = "CAP_SYS_MODULE"
