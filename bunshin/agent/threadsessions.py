"""Sessions as threads of the agent itself (``--calls thread``, the default).

The shell, its pty and a reader thread live in the agent, as before the agent could
serve calls from forked workers: no process between a call and its shell, but in a
clone every page a run writes is the agent's. The shell protocol (markers, recovery
on timeout) is the one ``sessions`` describes; ``--calls fork`` uses the holder
processes there instead.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any

from . import procfs
from .children import Child, Reaper
from .execs import DEFAULT_MAX_OUTPUT
from .imagedefaults import IMAGE
from .protocol import AgentFailure, arg_int, arg_str, arg_timeout, cannot_start
from .shellpty import SESSION_ENV, PtyShell, Sink, check_session_cap
from .terminals import pick_shell, start_shell
from .wire import ErrorCode


class ThreadSession(PtyShell):
    """One shell on one pty. ``run`` is serialised; a busy session says so."""

    def __init__(self, session_id: str, kind: str, child: Child, master: int, script: str) -> None:
        self.session_id = session_id
        self.kind = kind
        self.child = child
        self.master = master
        self.script = script
        self._run_lock = threading.Lock()
        self._sink_lock = threading.Lock()
        self._sink: Sink | None = None
        self._eof = threading.Event()
        self._closed = False  # fds released; guarded by _fd_lock
        self._fd_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._reader = threading.Thread(
            target=self._read_loop, name=f"pty-{session_id}", daemon=True
        )
        try:
            self._reader.start()
        except RuntimeError as exc:  # "can't start new thread": the pids limit
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            raise cannot_start("a session's reader thread", exc) from None
        child.on_exit(lambda _child: self._wake())

    @classmethod
    def open(
        cls, reaper: Reaper, session_id: str, req: dict[str, Any], scripts_dir: str
    ) -> ThreadSession:
        kind, argv = pick_shell(arg_str(req, "kind", None), interactive_rc=False)
        child, master = start_shell(reaper, argv, req, echo=False, extra_env=SESSION_ENV)
        script = os.path.join(scripts_dir, f"{session_id}.sh")
        try:
            session = cls(session_id, kind, child, master, script)
        except BaseException:
            procfs.kill_session(child.pid)
            os.close(master)
            raise
        try:
            session._start(argv[0])
        except BaseException:
            session.close()
            raise
        return session

    # --- state --------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self.child.done and not self._eof.is_set()

    @property
    def busy(self) -> bool:
        return self._run_lock.locked()

    def info(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "kind": self.kind,
            "pid": self.child.pid,
            "busy": self.busy,
            "alive": self.alive,
        }

    def _shell_pid(self) -> int:
        return self.child.pid

    def _exit_code_within(self, seconds: float) -> int | None:
        self.child.wait(seconds)
        return self.child.exit_code

    def _pause(self, seconds: float) -> None:
        time.sleep(seconds)  # the reader thread drains the pty meanwhile

    # --- running ------------------------------------------------------------------

    def run(self, command: str, timeout: float | None, limit: int) -> dict[str, Any]:
        if not self._run_lock.acquire(blocking=False):
            raise AgentFailure(ErrorCode.STATE_CONFLICT, f"session {self.session_id} is busy")
        try:
            return self._run(command, timeout, limit)
        finally:
            self._run_lock.release()

    def _wait(self, sink: Sink, timeout: float | None) -> bool:
        """True once ``sink`` saw its end marker; False on timeout or if the shell is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return sink.matched
            if sink.done.wait(0.5 if remaining is None else min(remaining, 0.5)):
                return sink.matched
            self._resume_if_stopped()
            if not self.alive:
                sink.done.wait(0.1)  # the reader drains what the shell left
                return sink.matched

    def _install(self, sink: Sink | None) -> None:
        with self._sink_lock:
            self._sink = sink

    # --- pty reader ---------------------------------------------------------------

    def _wake(self) -> None:
        with self._fd_lock:
            if not self._closed:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass

    def _read_loop(self) -> None:
        """Drain the pty all the time (a background job must never block on it)."""
        poller = select.poll()  # not selectors: less Python run per chunk the shell prints
        poller.register(self.master, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        wake = self._wake_r
        try:
            while True:
                events = poller.poll()
                if any(fd == wake for fd, _ in events):
                    # The shell exited or close() was called: drain what is left.
                    os.set_blocking(self.master, False)
                try:
                    data = os.read(self.master, 1 << 16)
                except BlockingIOError:
                    break
                except OSError:  # EIO: every slave end is closed
                    break
                if not data:
                    break
                with self._sink_lock:
                    sink = self._sink
                if sink is not None:
                    sink.feed(data)
        finally:
            self._eof.set()
            with self._sink_lock:
                if self._sink is not None:
                    self._sink.done.set()

    def close(self) -> None:
        """Kill the shell and everything in its session; release the pty.

        The descriptors are closed only here, once the reader has stopped and no
        run is writing, so a stale descriptor number is never written to.
        """
        if not self.child.done:
            procfs.kill_session(self.child.pid, signal.SIGKILL)
        self._wake()
        self._reader.join(5.0)
        got_run_lock = self._run_lock.acquire(timeout=5.0)
        try:
            with self._fd_lock:
                if got_run_lock and not self._closed and not self._reader.is_alive():
                    self._closed = True
                    for fd in (self.master, self._wake_r, self._wake_w):
                        os.close(fd)
        finally:
            if got_run_lock:
                self._run_lock.release()
        try:
            os.unlink(self.script)
        except OSError:
            pass


class ThreadSessions:
    """The agent's sessions by id, each a ``ThreadSession`` in the agent."""

    def __init__(self, reaper: Reaper, scripts_dir: str) -> None:
        self._reaper = reaper
        self._scripts_dir = scripts_dir
        self._lock = threading.Lock()
        self._sessions: dict[str, ThreadSession] = {}
        self._counter = 0
        self._opening = 0  # opens in progress: they count against the cap too

    def _get(self, req: dict[str, Any]) -> ThreadSession:
        session_id = arg_str(req, "session_id")
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise AgentFailure(ErrorCode.NOT_FOUND, f"no session {session_id!r}")
        return session

    def open(self, req: dict[str, Any]) -> dict[str, Any]:
        os.makedirs(self._scripts_dir, mode=0o700, exist_ok=True)
        if IMAGE is not None and IMAGE.user:
            # the image's user reads the command scripts (the folder stays root's: nothing
            # the user plants there is followed by the agent)
            os.chmod(self._scripts_dir, 0o711)
        with self._lock:
            check_session_cap(len(self._sessions) + self._opening)
            self._opening += 1
            self._counter += 1
            session_id = f"s{self._counter}-{os.urandom(3).hex()}"
        try:
            session = ThreadSession.open(self._reaper, session_id, req, self._scripts_dir)
            with self._lock:
                self._sessions[session_id] = session
        finally:
            with self._lock:
                self._opening -= 1
        return {"session_id": session_id, "kind": session.kind, "pid": session.child.pid}

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        session = self._get(req)
        command = arg_str(req, "command")
        limit = arg_int(req, "max_output", DEFAULT_MAX_OUTPUT)
        return session.run(command, arg_timeout(req), limit)

    def close(self, req: dict[str, Any]) -> dict[str, Any]:
        session = self._get(req)
        with self._lock:
            self._sessions.pop(session.session_id, None)
        session.close()
        return {}

    def list(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            sessions = list(self._sessions.values())
        return {"sessions": [s.info() for s in sessions]}

    def close_all(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()
