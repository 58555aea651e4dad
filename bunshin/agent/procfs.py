"""Processes as ``/proc`` shows them (the agent's own pid namespace)."""

from __future__ import annotations

import os
import signal
from typing import NamedTuple


class ProcStat(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    name: str


def read_stat(pid: int) -> ProcStat | None:
    """Fields of ``/proc/PID/stat``; ``None`` if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The name is in parentheses and may itself contain ")" or spaces.
    open_paren, close_paren = raw.find("("), raw.rfind(")")
    fields = raw[close_paren + 2 :].split()
    if open_paren < 0 or len(fields) < 4:
        return None
    return ProcStat(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        state=fields[0],
        name=raw[open_paren + 1 : close_paren],
    )


def exit_status(pid: int) -> int | None:
    """The raw wait status of zombie ``pid`` (``/proc/PID/stat`` field 52), ``None`` if
    it is not a zombie (or gone): a process that is not the waiter's parent learns how
    a child of its parent ended, before the parent reaps it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 50 or fields[0] != "Z":
        return None
    return int(fields[49])


def pids() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [os.fsdecode(part) for part in raw.rstrip(b"\0").split(b"\0")] if raw else []


def list_processes() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for pid in pids():
        stat = read_stat(pid)
        if stat is not None:
            out.append(
                {
                    "pid": pid,
                    "ppid": stat.ppid,
                    "pgid": stat.pgid,
                    "sid": stat.sid,
                    "state": stat.state,
                    "name": stat.name,
                    "cmdline": cmdline(pid),
                }
            )
    return out


def kill_session(sid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process of session ``sid`` (a shell and its jobs)."""
    for pid in pids():
        stat = read_stat(pid)
        if stat is not None and stat.sid == sid:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
