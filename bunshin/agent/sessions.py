"""Persistent shell sessions on ptys, each in a process of its own.

A session is ``bash -i`` (or ``sh -i`` when the image has no bash) on a pty,
session leader with the pty as controlling terminal, prompts empty, echo off.
A run writes the command to a script file and types one line into the shell::

    printf START; history -s "$(< script)"; source script; printf END$?

so the state (cwd, variables, functions, history) lives on in the shell, a
multi-line command works, and a command that reads stdin cannot swallow the
marker line. Markers hold a fresh random token and are produced by ``printf``
octal escapes, so the typed line (even if echoed) never contains them.

On timeout: ^C to the pty (SIGINT to the foreground job), then SIGKILL of the
foreground process group if it is still there after ~1 s; the shell survives
and is re-synchronised with a fresh marker before the next run.

Where they live: ``session_open`` forks a *holder* (named ``bunshin-session``)
that starts the shell, owns the pty and listens on ``<run>/sessions/<id>.sock``;
``Sessions`` (in the worker serving a call, or the job running one) reaches it
there. The holder is single-threaded: between runs it drains the pty (a
background job must never block on it); for each run it forks a child that
does the run and answers the caller, and stops reading until that child exits.
So a run writes only pages of a process that ends with it; the holder itself
touches a few (the accept, the fork). A holder forked with the workspace (CRIU)
carries the shell, the pty and a run in progress into each clone.
"""

from __future__ import annotations

import gc
import os
import re
import select
import signal
import socket
import struct
import time
from typing import Any

from . import forks, procfs
from .children import Reaper
from .execs import DEFAULT_MAX_OUTPUT
from .imagedefaults import IMAGE
from .protocol import (
    AgentFailure,
    arg_int,
    arg_str,
    arg_timeout,
    cannot_start,
    failure,
    unix_address,
    unline,
)
from .shellpty import SESSION_ENV, PtyShell, Sink, check_session_cap
from .terminals import pick_shell, start_shell
from .wire import ErrorCode, ok_line


class Session(PtyShell):
    """One shell on one pty, as the holder and its run children see it (one thread)."""

    def __init__(self, session_id: str, kind: str, pid: int, master: int, script: str) -> None:
        self.session_id = session_id
        self.kind = kind
        self.pid = pid
        self.master = master
        self.script = script
        self.status: int | None = None  # the shell's raw wait status, once it ended
        self.eof = False  # every slave end of the pty is closed
        self.parent = True  # False in a run child: the shell is its parent's child

    @classmethod
    def start(cls, reaper: Reaper, session_id: str, req: dict[str, Any], scripts_dir: str) -> Session:
        """Start the shell (``reaper`` only forks: this process reaps it itself)."""
        kind, argv = pick_shell(arg_str(req, "kind", None), interactive_rc=False)
        child, master = start_shell(reaper, argv, req, echo=False, extra_env=SESSION_ENV)
        session = cls(session_id, kind, child.pid, master, os.path.join(scripts_dir, f"{session_id}.sh"))
        try:
            session._start(argv[0])
        except BaseException:
            session.kill()
            raise
        return session

    # --- state --------------------------------------------------------------------

    def exited(self) -> bool:
        """True once the shell has ended (its parent reaps it; a run child reads /proc)."""
        if self.status is not None:
            return True
        if self.parent:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.status = 0
                return True
            if pid:
                self.status = status
            return self.status is not None
        zombie = procfs.exit_status(self.pid)
        if zombie is not None or procfs.read_stat(self.pid) is None:
            self.status = 0 if zombie is None else zombie
        return self.status is not None

    @property
    def alive(self) -> bool:
        return not self.eof and not self.exited()

    @property
    def exit_code(self) -> int | None:
        return None if self.status is None else os.waitstatus_to_exitcode(self.status)

    def info(self, busy: bool) -> dict[str, Any]:
        return {"session_id": self.session_id, "kind": self.kind, "pid": self.pid, "busy": busy,
                "alive": self.alive}

    def _shell_pid(self) -> int:
        return self.pid

    def _exit_code_within(self, seconds: float) -> int | None:
        deadline = time.monotonic() + seconds
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.exit_code

    # --- running ------------------------------------------------------------------

    def run(self, command: str, timeout: float | None, limit: int) -> dict[str, Any]:
        return self._run(command, timeout, limit)

    def read(self, wait: float, sink: Sink | None) -> None:
        """Read what the pty has within ``wait`` s into ``sink`` (``None``: discard)."""
        if self.eof:
            if wait > 0:
                time.sleep(wait)
            return
        readable, _, _ = select.select([self.master], [], [], max(wait, 0.0))
        if not readable:
            return
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: every slave end is closed
            data = b""
        if not data:
            self.eof = True
            if sink is not None:
                sink.done.set()
        elif sink is not None:
            sink.feed(data)

    def _pause(self, seconds: float) -> None:
        """Drain the pty for ``seconds`` (at least once), discarding what it says."""
        deadline = time.monotonic() + seconds
        while True:
            self.read(max(0.0, deadline - time.monotonic()), None)
            if time.monotonic() >= deadline or self.eof:
                return

    def _wait(self, sink: Sink, timeout: float | None) -> bool:
        """True once ``sink`` saw its end marker; False on timeout or if the shell is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return sink.matched
            self.read(0.5 if remaining is None else min(remaining, 0.5), sink)
            if sink.done.is_set():
                return sink.matched
            self._resume_if_stopped()
            if not self.alive:
                drain_until = time.monotonic() + 0.1  # what the shell left
                while not sink.done.is_set() and not self.eof and time.monotonic() < drain_until:
                    self.read(drain_until - time.monotonic(), sink)
                return sink.matched

    def kill(self) -> None:
        """Kill the shell and everything in its session."""
        procfs.kill_session(self.pid, signal.SIGKILL)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


class Holder:
    """The process that keeps one session: the pty's reader between calls, its socket.

    Like the agent it answers nothing itself: to each connection it lends the pty, with
    one message (``HOLDER_PID SHELL_PID KIND STATUS`` and the master descriptor, passed
    with ``SCM_RIGHTS``), and does not read the pty until every borrower has hung up.
    The borrower (the worker or job serving the call: ``Sessions``) parses the request
    and runs it. A run claims the session with a marker file made ``O_EXCL``
    (``<id>.run``, its pid inside), so a second run, or a list, sees it busy.
    """

    def __init__(self, session: Session, listen: socket.socket) -> None:
        self.session = session
        self.listen = listen
        self.lent: dict[int, socket.socket] = {}  # connections that hold the pty
        self._fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", session.master))]
        self._header = b""
        self._describe()

    def _describe(self) -> None:
        s = self.session
        status = "-" if s.status is None else str(s.status)
        self._header = f"{os.getpid()} {s.pid} {s.kind} {status}\n".encode()

    def serve(self) -> None:
        s = self.session
        listen = self.listen.fileno()
        accept = self.listen._accept  # type: ignore[attr-defined]  # noqa: SLF001 - a raw fd: no enum lookups
        lent = self.lent
        unix, stream = socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC
        fds_message = [self._header]
        while True:
            fds = [listen, *lent]
            if not lent and not s.eof:
                fds.append(s.master)
            readable, _, _ = select.select(fds, [], [])
            for fd in readable:
                conn = lent.pop(fd, None)
                if conn is not None:  # the borrower hung up (it sends nothing)
                    conn.close()
            if not lent:
                if s.status is None and s.exited():
                    self._describe()
                if s.master in readable:
                    s.read(0.0, None)
            if listen in readable:
                try:
                    fd, _ = accept()
                except OSError:
                    continue
                conn = socket.socket(unix, stream, 0, fd)
                try:
                    fds_message[0] = self._header
                    conn.sendmsg(fds_message, self._fds)
                except OSError:
                    conn.close()
                    continue
                lent[fd] = conn


class _Borrowed:
    """A session's pty lent by its holder for one call (see ``Holder``)."""

    def __init__(self, session_id: str, path: str, scripts_dir: str) -> None:
        self.path = path
        self.marker = f"{path[: -len('.sock')]}.run"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            address, dir_fd = unix_address(path)
            try:
                self.sock.connect(address)
            finally:
                if dir_fd is not None:
                    os.close(dir_fd)
            self.sock.settimeout(10.0)
            data, fds, _, _ = socket.recv_fds(self.sock, 256, 1)
            fields = data.decode().split()
            if len(fds) != 1 or len(fields) != 4:
                for fd in fds:
                    os.close(fd)
                raise ConnectionError(f"session {session_id}: its holder sent {data[:80]!r}")
            self.holder = int(fields[0])
            self.session = Session(session_id, fields[2], int(fields[1]), fds[0],
                                   os.path.join(scripts_dir, f"{session_id}.sh"))
            self.session.parent = False
            if fields[3] != "-":
                self.session.status = int(fields[3])
        except BaseException:
            self.sock.close()
            raise

    def __enter__(self) -> _Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.session.master)
        self.sock.close()  # the holder reads the pty again

    def close(self) -> None:
        """Kill the shell and its jobs and the holder (which owns the pty): the session is gone."""
        self.session.kill()
        try:
            os.kill(self.holder, signal.SIGKILL)
        except OSError:
            pass
        for path in (self.session.script, self.path, self.marker):
            _unlink(path)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            stat = procfs.read_stat(self.holder)
            if stat is None or stat.state == "Z" or stat.name != forks.SESSION:
                return
            time.sleep(0.005)


def _claim(marker: str) -> bool:
    """Make the run marker; False if a live run holds it (a stale one is replaced)."""
    for _ in range(3):
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            if _busy(marker):
                return False
            _unlink(marker)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return True
    return False


def _busy(marker: str) -> bool:
    """True if the marker names a run that is still going."""
    try:
        with open(marker, "rb", opener=lambda path, flags: os.open(path, flags | os.O_NOFOLLOW)) as f:
            text = f.read(32)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if not text.strip():
        return True  # just made, its pid not written yet
    try:
        pid = int(text)
    except ValueError:
        return False
    stat = procfs.read_stat(pid)
    return stat is not None and stat.state != "Z"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_ID = re.compile(r"s(\d+)-[0-9a-f]{6}")


class Sessions:
    """The sessions, as a call sees them: holders listening in ``folder``."""

    def __init__(self, folder: str, scripts_dir: str) -> None:
        self._folder = folder  # the holders' sockets and run markers
        self._scripts_dir = scripts_dir  # the scripts the shells source

    def _socket(self, session_id: str) -> str:
        return os.path.join(self._folder, f"{session_id}.sock")

    def _borrow(self, session_id: str) -> _Borrowed:
        if not _ID.fullmatch(session_id):
            raise AgentFailure(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        try:
            return _Borrowed(session_id, self._socket(session_id), self._scripts_dir)
        except (FileNotFoundError, ConnectionRefusedError):
            raise AgentFailure(ErrorCode.NOT_FOUND, f"no session {session_id!r}") from None
        except OSError as exc:
            raise AgentFailure(ErrorCode.AGENT_ERROR, f"session {session_id}: {exc}") from None

    def _ids(self) -> list[str]:
        try:
            names = os.listdir(self._folder)
        except FileNotFoundError:
            return []
        ids = [n[: -len(".sock")] for n in names if n.endswith(".sock")]
        return sorted((i for i in ids if _ID.fullmatch(i)), key=lambda i: int(i[1:].split("-")[0]))

    def open(self, req: dict[str, Any]) -> dict[str, Any]:
        """Fork the session's holder; answer once its shell is ready (or why it is not)."""
        os.makedirs(self._folder, mode=0o700, exist_ok=True)
        os.makedirs(self._scripts_dir, mode=0o700, exist_ok=True)
        if IMAGE is not None and IMAGE.user:
            # the image's user reads the command scripts (the folder stays root's: nothing
            # the user plants there is followed by the agent)
            os.chmod(self._scripts_dir, 0o711)
        pick_shell(arg_str(req, "kind", None), interactive_rc=False)  # a bad kind fails here
        ids = self._ids()
        check_session_cap(len(ids))  # each holder listens on its socket there, also while it starts
        numbers = [int(_ID.fullmatch(i).group(1)) for i in ids]  # type: ignore[union-attr]
        session_id = f"s{max(numbers, default=0) + 1}-{os.urandom(3).hex()}"
        path = self._socket(session_id)
        listen = forks.listen_at(path)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = forks.fork(forks.SESSION)
        except OSError as exc:
            listen.close()
            os.unlink(path)
            for fd in (ready_r, ready_w):
                os.close(fd)
            raise cannot_start("a session", exc) from None
        if pid == 0:
            forks.keep_only(listen.fileno(), ready_w)
            forks.run_and_exit(lambda: _hold(session_id, req, listen, path, self._scripts_dir, ready_w))
        listen.close()
        os.close(ready_w)
        with os.fdopen(ready_r, "rb") as ready:
            line = ready.readline()
        if not line:
            raise AgentFailure(ErrorCode.AGENT_ERROR, f"session {session_id} ended before its shell started")
        return unline(line)

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        session_id = arg_str(req, "session_id")
        command = arg_str(req, "command")
        limit = arg_int(req, "max_output", DEFAULT_MAX_OUTPUT)
        timeout = arg_timeout(req)
        with self._borrow(session_id) as lent:
            if not _claim(lent.marker):
                raise AgentFailure(ErrorCode.STATE_CONFLICT, f"session {session_id} is busy")
            try:
                return lent.session.run(command, timeout, limit)
            finally:
                _unlink(lent.marker)

    def close(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._borrow(arg_str(req, "session_id")) as lent:
            lent.close()
        return {}

    def list(self, req: dict[str, Any]) -> dict[str, Any]:
        sessions = []
        for session_id in self._ids():
            try:
                with self._borrow(session_id) as lent:
                    sessions.append(lent.session.info(_busy(lent.marker)))
            except AgentFailure as exc:
                if exc.code != ErrorCode.NOT_FOUND:
                    raise
        return {"sessions": sessions}


def _hold(session_id: str, req: dict[str, Any], listen: socket.socket, path: str, folder: str,
          ready: int) -> None:
    """The holder's life: start the shell, say so on ``ready``, serve until closed."""
    try:
        session = Session.start(Reaper(), session_id, req, folder)
    except AgentFailure as exc:
        os.write(ready, failure(exc))
        os.unlink(path)
        return
    except Exception as exc:
        os.write(ready, failure(AgentFailure(ErrorCode.AGENT_ERROR, f"cannot start a session: {exc!r}")))
        os.unlink(path)
        return
    os.write(ready, ok_line({"session_id": session_id, "kind": session.kind, "pid": session.pid}))
    os.close(ready)
    holder = Holder(session, listen)
    # What the holder has now lives as long as it does: off the cyclic GC, so that a
    # collection in a clone does not write (and so copy) the pages those objects are on.
    gc.collect()
    gc.freeze()
    holder.serve()
