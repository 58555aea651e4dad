"""After a batch of restores: every restored process is still there, or the batch fails naming the dead one.

A restored process can die on arrival (a signal the restore or the trap caused,
SIGSYS, SIGSEGV...): CRIU has exited by then and reports success. ``Watch``
listens to the kernel's process events (the proc connector: ``NETLINK_CONNECTOR``,
group ``CN_IDX_PROC``; ``CAP_NET_ADMIN`` in the initial user namespace, root here)
from before the first restore to the check: every fork and every exit on the host,
with the exit's wait status, also of a process its parent reaped at once (a
workspace's pid 1, the agent, reaps its children). ``check`` then lists each clone's
procfs (``/proc/ROOT/root/proc``: the pids inside, as the dump numbers them, CRIU
restores them the same): a dumped process that is gone, or a zombie, and died by a
signal (its own wait status, or an exit by a signal among the clone's descendants,
known from the fork events) fails the batch, named by pid, command line (read from
its dump: the argument area of its stack) and signal; so does one stopped that ran
when dumped, or has a thread stopped or traced (``T``, ``t``), or hung: a thread in
uninterruptible sleep (``D``) that does not run at all (its ``schedstat`` run time
stays) for ``HUNG_S`` after the check first sees it (a thread that sleeps in ``D``
and runs between, faulting pages in, is not). A dumped process that exited normally
is not a failure: it may simply have finished; nor is a zombie of the dump
(restored as one). A process that dies after the check, or one that hangs in an
interruptible sleep or running, is not seen. The check reads each restored
thread's ``stat`` once (its cost per task is in ``check``'s result); only a thread
seen in ``D`` is read again (after 0.5 ms, then twice as long each time up to 10 ms) until it
runs or ``HUNG_S`` passes.

The clone's procfs is the clone's to arrange were it able to mount: it is read through
:mod:`..kernel.procfs` (``proc`` opened with ``O_NOFOLLOW`` and kept only if it is procfs,
every name under it opened beneath it following no symlink and crossing no mount, every read
bounded); a clone whose ``proc`` is not its procfs fails the batch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bunshin.errors import RuntimeFailure

from ..kernel import procfs
from ..kernel.procfs import open_at, read_at
from ..memfile.criu_images import dumped_command as command
from ..memfile.criu_images import load

NETLINK_CONNECTOR, CN_IDX_PROC, CN_VAL_PROC = 11, 1, 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
PROC_EVENT_FORK, PROC_EVENT_EXIT = 0x1, 0x80000000
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp
_FORK = struct.Struct("=iiii")  # parent pid, tgid, child pid, tgid
_EXIT = struct.Struct("=iiIIii")  # pid, tgid, exit code (wait status), exit signal, parent pid, tgid
_RCVBUF = 8 << 20
NLMSG_DONE = 3
TASK_ALIVE, TASK_DEAD, TASK_STOPPED, TASK_ZOMBIE = 1, 2, 3, 6  # CRIU's core tc.task_state (compel)
HUNG_S = 1.0  # a thread in D that has not run for this long after the check first saw it: hung
_POLL_S, _FIRST_POLL_S = 0.01, 0.0005


@dataclass(frozen=True)
class Dead:
    """A dumped process gone from its clone or a zombie there (died), or stopped there."""

    clone: str
    pid: int  # inside the clone
    command: str
    signal: int | None  # what killed it, if known
    stopped: bool = False  # stopped or traced (it ran when dumped), not dead
    hung: str = ""  # a thread of it in uninterruptible sleep that did not run: "thread TID in WCHAN"


@dataclass(frozen=True)
class Checked:
    """What one check cost."""

    ms: float  # the check after the restores (wall)
    tasks: int  # restored threads whose state was read
    watch_cpu_ms: float = 0.0  # the event watch's thread during the restores and the check (CPU)

    @property
    def us_per_task(self) -> float:
        return self.ms * 1000 / self.tasks if self.tasks else 0.0


@dataclass
class _Events:
    parent: dict[int, int] = field(default_factory=dict)  # process (tgid) -> the process that forked it
    exits: dict[int, int] = field(default_factory=dict)  # tgid -> wait status of the process's exit
    lost: bool = False  # the socket overflowed: some events are missing


class Watch:
    """The host's fork and exit events from ``start`` to ``close``: collected by a thread as
    they come (a batch of restores takes long enough to fill the socket), or, for one
    restore (``start(thread=False)``), left in the socket's buffer (``_RCVBUF``: some 10^4
    events) until the check reads them; a thread all the same where that buffer could not
    be had (``SO_RCVBUFFORCE`` needs ``CAP_NET_ADMIN``)."""

    def __init__(self) -> None:
        self.events = _Events()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._wake: tuple[int, int] | None = None  # a pipe: ``close`` ends the thread's wait at once
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self.cpu_s = 0.0

    def start(self, *, thread: bool = True) -> Watch:
        """Subscribe; without the connector (no permission, no kernel support) nothing is
        collected. ``thread=False``: no thread, the events wait in the socket (see the class)."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        except OSError:
            return self
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, _RCVBUF)  # SO_RCVBUFFORCE
            except OSError:
                thread = True  # the default buffer (rmem_default) holds a few hundred events
            sock.bind((0, CN_IDX_PROC))
            sock.send(_request(PROC_CN_MCAST_LISTEN))
        except OSError:
            sock.close()
            return self
        self._sock = sock
        if not thread:
            return self
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._run, name="restore-check", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        assert self._sock is not None and self._wake is not None
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock.fileno(), self._wake[0]], [], [])
                if self._sock.fileno() in ready:
                    self._drain()
            except OSError:
                pass
            self.cpu_s = time.thread_time()  # this thread's CPU time so far: the watch's cost

    def _drain(self) -> None:
        """Take every event waiting on the socket (the thread's, and the check's before it reads)."""
        t0 = time.thread_time()
        try:
            self._drain_socket()
        finally:
            if self._thread is None:  # no thread: the watch's cost is what the check spent here
                self.cpu_s += time.thread_time() - t0

    def _drain_socket(self) -> None:
        with self._recv_lock:
            while self._sock is not None:
                try:
                    self._take(self._sock.recv(1 << 16, socket.MSG_DONTWAIT))
                except BlockingIOError:
                    return
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        return
                    self.events.lost = True  # the socket overflowed: events were dropped (read on)

    def _take(self, data: bytes) -> None:
        at = 0
        while at + _NLMSG.size <= len(data):
            length = _NLMSG.unpack_from(data, at)[0]
            if length < _NLMSG.size:
                return
            body = at + _NLMSG.size + _CN_MSG.size
            what = _EVENT.unpack_from(data, body)[0] if body + _EVENT.size <= len(data) else 0
            ev = body + _EVENT.size
            with self._lock:
                if what == PROC_EVENT_FORK:
                    _, ptgid, cpid, ctgid = _FORK.unpack_from(data, ev)
                    if cpid == ctgid:  # a process, not a thread
                        self.events.parent[ctgid] = ptgid
                elif what == PROC_EVENT_EXIT:
                    pid, tgid, code, _, _, _ = _EXIT.unpack_from(data, ev)
                    if pid == tgid:
                        self.events.exits[tgid] = code
            at += (length + 3) & ~3

    def signals_under(self, root: int) -> list[int]:
        """Signals that ended ``root`` or a process descended from it (forked since ``start``)."""
        self._drain()  # every exit so far: a process's exit event is sent before its parent can reap it
        with self._lock:
            parent, exits = dict(self.events.parent), dict(self.events.exits)
        out = []
        for tgid, status in exits.items():
            seen, p = 0, tgid
            while p != root and p in parent and seen < 4096:
                p, seen = parent[p], seen + 1
            if p == root and os.WIFSIGNALED(status):
                out.append(os.WTERMSIG(status))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        if self._thread is not None:
            self._thread.join()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        if self._sock is not None:
            with self._recv_lock:
                with contextlib.suppress(OSError):
                    self._sock.send(_request(PROC_CN_MCAST_IGNORE))
                self._sock.close()
                self._sock = None


def _request(op: int) -> bytes:
    payload = struct.pack("=I", op)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return _NLMSG.pack(_NLMSG.size + len(cn), NLMSG_DONE, 0, 0, 0) + cn


def _clone_proc(clone: str, root: int) -> int | None:
    """A descriptor of the procfs of the clone whose pid 1 is ``root`` (host pid), None if the
    clone is gone; ``RuntimeFailure`` if its ``proc`` is a symlink or no procfs."""
    try:
        return procfs.open_proc(f"/proc/{root}/root")
    except procfs.NotProcfs as e:
        raise RuntimeFailure(f"clone {clone}: its processes cannot be checked after the restore: {e.strerror}",
                             hint="the fork made no clones; the workspace's /proc was replaced: fork with "
                                  "mode='copy', or remove the workspace") from None
    except OSError:
        return None


def _inside(proc: int) -> dict[int, dict[int, str]]:
    """Processes of the clone whose procfs is ``proc``: pid inside -> {tid: state letter} of
    its threads (the leader's under its pid). Read relative to descriptors of the clone's
    procfs: a path through ``/proc/ROOT/root`` walks that link again for each file (5x the time)."""
    out: dict[int, dict[int, str]] = {}
    for n in os.listdir(proc):
        if n.isdigit():
            states = _states(proc, n)
            if states:
                out[int(n)] = states
    return out


def _states(proc: int, pid: str) -> dict[int, str]:
    """{tid: state letter} of process ``pid``'s threads (what could be read of them; the
    ``task`` folder only of one with more threads than its leader, ``num_threads``)."""
    states: dict[int, str] = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = read_at(proc, f"{pid}/stat")
        after = stat[stat.rindex(b")") + 2:]
        states[int(pid)] = chr(after[0])
        if after.split(maxsplit=18)[17] == b"1":  # num_threads (field 20): the leader alone
            return states
        task = open_at(proc, f"{pid}/task", directory=True)
        try:
            for t in os.listdir(task):
                if t != pid:
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        states[int(t)] = _state(read_at(task, f"{t}/stat"))
        finally:
            os.close(task)
    return states


def _state(stat: str | bytes) -> str:
    if isinstance(stat, bytes):
        stat = stat.decode(errors="replace")
    return stat[stat.rindex(")") + 2]


def _text(proc: int, path: str) -> str:
    return read_at(proc, path).decode(errors="replace")


def _ran(proc: int, task: str) -> str | None:
    """What shows that a thread ran: its run time (``schedstat``), else its context switches."""
    with contextlib.suppress(OSError, IndexError):
        return _text(proc, f"{task}/schedstat").split()[0]
    with contextlib.suppress(OSError):
        status = read_at(proc, f"{task}/status", 2 * procfs.MAX_READ).decode(errors="replace")
        return ",".join(line for line in status.splitlines() if "ctxt_switches" in line)
    return None


def _hung(proc: int, waiting: list[tuple[int, int]]) -> dict[int, str]:
    """Of the threads (pid, tid) seen in D: those still in D that did not run for ``HUNG_S``
    (pid -> "thread TID in WCHAN")."""
    task = {w: f"{w[0]}/task/{w[1]}" for w in waiting}
    first = {w: _ran(proc, t) for w, t in task.items()}
    end = time.monotonic() + HUNG_S
    left = set(waiting)
    nap = _FIRST_POLL_S  # most D sleeps right after a restore (a page read) end within it
    while left and time.monotonic() < end:
        time.sleep(nap)
        nap = min(nap * 2, _POLL_S)
        for w in list(left):
            try:
                still = _state(read_at(proc, f"{task[w]}/stat")) == "D"
            except (OSError, IndexError):
                still = False
            if not still or _ran(proc, task[w]) != first[w]:
                left.discard(w)
    out: dict[int, str] = {}
    for pid, tid in sorted(left):
        wchan = ""
        with contextlib.suppress(OSError):
            wchan = _text(proc, f"{task[(pid, tid)]}/wchan").strip()
        out.setdefault(pid, f"thread {tid} in uninterruptible sleep" + (f" ({wchan})" if wchan not in ("", "0") else ""))
    return out


def _zombie_signal(proc: int, pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        stat = _text(proc, f"{pid}/stat")
        status = int(stat[stat.rindex(")") + 2:].split()[49])  # exit_code, field 52
        return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return None


def _dumped_state(images: Path, pid: int) -> int:
    """The task state CRIU dumped for ``pid`` (``TASK_ALIVE`` if unreadable)."""
    with contextlib.suppress(OSError, KeyError, IndexError, ValueError, TypeError):
        return int(load(images / f"core-{pid}.img")["entries"][0]["tc"]["task_state"])
    return TASK_ALIVE


def _odd(states: dict[int, str] | None) -> bool:
    return states is None or any(c in "ZTtD" for c in states.values())


def _clone_dead(images: Path, entries: list[dict[str, Any]], clone: str, root: int, proc: int | None,
                watch: Watch, live: dict[int, dict[int, str]] | None) -> list[Dead]:
    odd = [e["pid"] for e in entries if live is None or _odd(live.get(e["pid"]))]
    out: list[Dead] = []
    signals: list[int] | None = None
    waiting: list[tuple[int, int]] = []
    for pid in odd:
        states = live.get(pid) if live is not None else None
        state = states.get(pid) if states else None
        if states and state != "Z" and not any(c in "Tt" for c in states.values()):
            waiting += [(pid, tid) for tid, c in states.items() if c == "D"]  # alive; in D: hung?
            continue
        dumped = _dumped_state(images, pid)  # (read only for what looks wrong)
        if dumped in (TASK_DEAD, TASK_ZOMBIE):
            continue  # a zombie in the dump is one in the clone
        if states and state != "Z":
            if dumped != TASK_STOPPED:
                out.append(Dead(clone, pid, command(images, pid), None, stopped=True))
            continue
        sig = _zombie_signal(proc, pid) if state == "Z" and proc is not None else None
        if sig is None:
            signals = watch.signals_under(root) if signals is None else signals
            sig = signals[0] if signals else None  # reaped already: what killed a process of the clone
        if sig is not None or live is None:  # an exit without a signal: the process may have finished
            out.append(Dead(clone, pid, command(images, pid), sig))
    if waiting and proc is not None:
        out += [Dead(clone, pid, command(images, pid), None, hung=what) for pid, what in _hung(proc, waiting).items()]
    return out


def dead(images: Path, clones: Sequence[tuple[str, int]], watch: Watch) -> list[Dead]:
    """The dumped processes of ``images`` that died by a signal, or stopped or hung, in each
    (clone id, pid 1's host pid)."""
    return _dead(images, clones, watch)[0]


def _dead(images: Path, clones: Sequence[tuple[str, int]], watch: Watch) -> tuple[list[Dead], int]:
    entries = load(images / "pstree.img")["entries"]
    out: list[Dead] = []
    tasks = 0
    for clone, root in clones:
        proc = _clone_proc(clone, root)
        try:
            live = _inside(proc) if proc is not None else None
            tasks += sum(len(s) for s in live.values()) if live else 0
            out += _clone_dead(images, entries, clone, root, proc, watch, live)
        finally:
            if proc is not None:
                os.close(proc)
    return out, tasks


def check(images: Path, clones: Sequence[tuple[str, int]], watch: Watch) -> Checked:
    """Raise ``RuntimeFailure`` naming the first dead, stopped or hung restored process; the check's cost."""
    t0 = time.perf_counter()
    found, tasks = _dead(images, clones, watch)
    if found:
        d = found[0]
        if d.stopped:
            what = "is stopped right after its restore (it was running when dumped)"
        elif d.hung:
            what = f"is hung right after its restore: {d.hung} did not run for {HUNG_S:g} s"
        else:
            cause = f"signal {d.signal} ({signal.Signals(d.signal).name})" if d.signal else "an unknown cause"
            what = f"died of {cause} right after its restore"
        raise RuntimeFailure(
            f"process {d.pid} ({d.command}) of clone {d.clone} {what}"
            + (f"; {len(found) - 1} more failed" if len(found) > 1 else ""),
            hint="the fork made no clones; report this with the program (see README 'Live fork'): "
                 "fork with mode='copy' meanwhile",
            dead=[{"clone": x.clone, "pid": x.pid, "command": x.command, "signal": x.signal, "stopped": x.stopped,
                   "hung": x.hung} for x in found],
        )
    return Checked((time.perf_counter() - t0) * 1000, tasks, watch.cpu_s * 1000)


__all__ = ["Checked", "Dead", "Watch", "check", "command", "dead"]
