"""The shell protocol both kinds of session speak on their pty.

A run writes the command to a script file and types one marker line (``run_line``);
``Sink`` finds the markers in what the pty says; on timeout the foreground job is
interrupted, then killed, and the shell re-synchronised (``_recover``). How the pty is
read is the kind's own: a reader thread in the agent (``threadsessions``) or the holder
and its run children reading it themselves (``sessions``).
"""

from __future__ import annotations

import os
import shlex
import signal
import termios
import time
from typing import Any

from . import procfs
from .execs import Capture
from .pool import Flag
from .protocol import AgentFailure
from .wire import ErrorCode

#: Extra environment of tool sessions: nothing may wait for a human at a pager.
SESSION_ENV = {"PAGER": "cat", "GIT_PAGER": "cat"}
START_TIMEOUT_S = 10.0
#: Most sessions open at once in one workspace. Each holds a shell and a thread or holder
#: process (two of the workspace's pids); without a cap, sessions opened in a loop take
#: the pids limit and the agent can then start no thread, so no exec either.
MAX_SESSIONS = 64
INTERRUPT_GRACE_S = 1.0
#: What a run's output says after the shell was found stopped and continued.
CONTINUED_NOTE = ("\n[bunshin: the session's shell or its foreground command was stopped (SIGSTOP) "
                  "and has been continued (SIGCONT)]\n")
_TAG = b"\x1eBS"
_MAX_MARKER = 64


def check_session_cap(open_now: int) -> None:
    """Refuse a new session while ``MAX_SESSIONS`` are open (``resource_exhausted``)."""
    if open_now >= MAX_SESSIONS:
        raise AgentFailure(
            ErrorCode.RESOURCE_EXHAUSTED,
            f"session limit reached: {open_now} sessions are open in this workspace (at most {MAX_SESSIONS})",
            hint="close sessions you no longer use (ws.sessions.list() or GET /workspaces/ID/sessions "
                 "shows them) and open the new one again",
        )


class Sink:
    """Finds one run's markers in the pty stream; keeps the output between them.

    With ``output`` false it only waits for a sync marker.
    """

    def __init__(self, token: str, limit: int, *, output: bool) -> None:
        tag = _TAG + token.encode()
        self._start: bytes | None = tag + b"S\x1e" if output else None
        self._end = tag + (b"E" if output else b"Y")  # then the exit code's digits (E only) and \x1e
        self._digits = output
        self._started = self._start is None
        self._window = bytearray()
        self.output = Capture(limit)
        self.matched = False
        self.exit_code: int | None = None
        self.done = Flag()  # set on the end marker or at the pty's end

    def feed(self, data: bytes) -> None:
        if self.done.is_set():
            return
        self._window += data
        if not self._started:
            assert self._start is not None
            at = self._window.find(self._start)
            if at < 0:
                del self._window[: max(0, len(self._window) - len(self._start))]
                return
            del self._window[: at + len(self._start)]
            self._started = True
        at, code = _find_end(self._window, self._end, self._digits)
        if at >= 0:
            self._keep(self._window[:at])
            self.exit_code = code
            self.matched = True
            self._window.clear()
            self.done.set()
        elif len(self._window) > _MAX_MARKER:
            cut = len(self._window) - _MAX_MARKER
            self._keep(self._window[:cut])
            del self._window[:cut]

    def flush(self) -> None:
        """Keep what is left of the window (the run ended without its end marker)."""
        if self._started:
            self._keep(self._window)
        self._window.clear()

    def _keep(self, data: bytes | bytearray) -> None:
        if self._start is not None:
            self.output.feed(bytes(data))


def _find_end(window: bytearray, end: bytes, digits: bool) -> tuple[int, int | None]:
    """Where the marker ``end`` + ``\\x1e`` starts in ``window`` (-1: not there yet), with
    ``digits`` one or more ASCII digits between the two (their value is returned; else
    ``None``). Plain ``find``: a regex made per run runs the ``re`` compiler on every call,
    and in a clone each object a call touches is a page copied."""
    start = 0
    while True:
        at = window.find(end, start)
        if at < 0:
            return -1, None
        stop = window.find(b"\x1e", at + len(end))
        if stop < 0:
            return -1, None
        between = bytes(window[at + len(end):stop])
        if digits and between.isdigit():
            return at, int(between)
        if not digits and not between:
            return at, None
        start = at + 1


class PtyShell:
    """One shell on one pty: what a run types and how it recovers. A kind provides
    ``alive``, ``_wait``, ``_shell_pid``, ``_exit_code_within`` and ``_pause``, and
    ``_install`` if a reader thread hands the pty's output to the current sink."""

    session_id: str
    kind: str
    master: int
    script: str
    _continued = False  # this run found the shell stopped and continued it

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def _wait(self, sink: Sink, timeout: float | None) -> bool:
        """True once ``sink`` saw its end marker; False on timeout or if the shell is gone."""
        raise NotImplementedError

    def _shell_pid(self) -> int:
        raise NotImplementedError

    def _exit_code_within(self, seconds: float) -> int | None:
        """The shell's exit code, waiting up to ``seconds`` for it to end."""
        raise NotImplementedError

    def _pause(self, seconds: float) -> None:
        """Let ``seconds`` pass (what the pty says meanwhile is not a run's output)."""
        raise NotImplementedError

    def _install(self, sink: Sink | None) -> None:
        """Where the pty's output goes from now on (``None``: discarded)."""

    def _resume_if_stopped(self) -> None:
        """Continue the shell, and the processes of the terminal's foreground group, if
        stopped (state ``T``): ``kill -STOP $$`` stops the shell for good (it reads and
        prints nothing until SIGCONT), and a shell without job control (``sh``: dash)
        waits for ever on a foreground command that stopped itself; so each later run
        would only time out. A job a shell with job control stopped and keeps ("[1]+
        Stopped", moved out of the foreground) is left as a terminal leaves it, and so is
        a tracer's stop (``t``)."""
        shell = self._shell_pid()
        try:
            foreground = os.tcgetpgrp(self.master)
        except OSError:
            foreground = shell
        for pid in procfs.pids():
            stat = procfs.read_stat(pid)
            if stat is None or stat.state != "T" or stat.sid != shell:
                continue
            if pid != shell and stat.pgid != foreground:
                continue
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                continue
            self._continued = True

    def _start(self, argv0: str) -> None:
        """Bring a just-started shell to the protocol: no prompts, no history file."""
        init = "PS1=; PS2=; "
        if self.kind == "bash":
            init += "PS0=; PROMPT_COMMAND=; unset MAILCHECK HISTFILE; HISTCONTROL=ignorespace; history -c; "
        if not self._sync(init, START_TIMEOUT_S):
            raise AgentFailure(ErrorCode.AGENT_ERROR, f"shell {argv0} did not start within {START_TIMEOUT_S:.0f} s")

    def _dead_error(self) -> AgentFailure:
        code = self._exit_code_within(1.0)
        return AgentFailure(
            ErrorCode.STATE_CONFLICT,
            f"session {self.session_id}: shell exited (status {code}); close it and open a new one",
        )

    def _run(self, command: str, timeout: float | None, limit: int) -> dict[str, Any]:
        if not self.alive:
            raise self._dead_error()
        self._reset_tty()
        os.makedirs(os.path.dirname(self.script), mode=0o700, exist_ok=True)
        with open(self.script, "w", encoding="utf-8", errors="surrogateescape",
                  opener=lambda path, flags: os.open(path, flags | os.O_NOFOLLOW, 0o644)) as f:
            f.write(command if command.endswith("\n") else command + "\n")
        token = os.urandom(8).hex()
        sink = Sink(token, limit, output=True)
        start = time.monotonic()
        self._continued = False
        self._resume_if_stopped()  # stopped since the last run (by a job of its own)
        self._install(sink)
        try:
            self._type(self._run_line(token))
            finished = self._wait(sink, timeout)
            timed_out = not finished and self.alive
            if timed_out:
                self._recover()
            sink.flush()
            if self._continued:
                sink.output.feed(CONTINUED_NOTE.encode())
            exit_code = sink.exit_code if finished else None
            if not self.alive:
                code = self._exit_code_within(1.0)
                exit_code = code if exit_code is None else exit_code
            return {
                "output": sink.output.text(),
                "exit_code": exit_code,
                "timed_out": timed_out,
                "truncated": sink.output.truncated,
                "duration_s": time.monotonic() - start,
                "alive": self.alive,
            }
        finally:
            self._install(None)

    def _run_line(self, token: str) -> str:
        script = shlex.quote(self.script)
        start = f"'\\036BS{token}S\\036'"
        end = f"'\\036BS{token}E%d\\036' \"$?\""
        if self.kind == "bash":
            return (
                f'builtin printf {start}; builtin history -s -- "$(< {script})"; '
                f"builtin source {script}; builtin printf {end}"
            )
        # ``command .``: a syntax error in the script must not abort the line.
        return f"command printf {start}; command . {script}; command printf {end}"

    def _sync(self, prefix: str, timeout: float) -> bool:
        """Type ``prefix`` and a sync marker; True once the shell printed the marker."""
        token = os.urandom(8).hex()
        sink = Sink(token, 0, output=False)
        self._install(sink)
        try:
            self._type(f"{prefix}command printf '\\036BS{token}Y\\036'")
            return self._wait(sink, timeout)
        except AgentFailure:
            return False
        finally:
            self._install(None)

    def _recover(self) -> None:
        """Interrupt the running command and bring the shell back to reading lines."""
        for _ in range(3):
            if not self.alive:
                return
            self._resume_if_stopped()
            self._install(None)  # what the interrupt prints is not the command's output
            try:
                os.write(self.master, b"\x03")
            except OSError:
                return
            fg = self._foreground_job(INTERRUPT_GRACE_S)
            if fg is not None:
                try:
                    os.killpg(fg, signal.SIGKILL)
                except OSError:
                    pass
                self._foreground_job(INTERRUPT_GRACE_S)
            self._reset_tty()
            # A builtin such as ``read`` may finish by swallowing the first sync
            # line: type more, waiting a little longer each time.
            for wait in (0.05, 0.1, 0.2, 0.4, 0.8):
                self._resume_if_stopped()  # the interrupted line may stop it yet (kill -STOP $$)
                if self._sync("", wait):
                    return

    def _foreground_job(self, within: float) -> int | None:
        """The foreground process group if it is not the shell's after ``within`` s."""
        deadline = time.monotonic() + within
        while True:
            try:
                fg = os.tcgetpgrp(self.master)
            except OSError:
                return None
            if fg in (self._shell_pid(), 0) or not self.alive:
                return None
            if time.monotonic() >= deadline:
                return fg
            self._pause(0.01)

    def _reset_tty(self) -> None:
        """Undo what a killed full-screen program may have left: canonical, no echo."""
        try:
            attrs = termios.tcgetattr(self.master)
            want = (attrs[3] | termios.ICANON | termios.ISIG) & ~termios.ECHO
            if want != attrs[3]:
                attrs[3] = want
                termios.tcsetattr(self.master, termios.TCSANOW, attrs)
        except termios.error:
            pass

    def _type(self, line: str) -> None:
        data = (" " + line + "\n").encode()
        try:
            while data:
                data = data[os.write(self.master, data) :]
        except OSError:
            raise self._dead_error() from None
