"""``exec`` (run to completion, capture output), ``spawn`` and ``kill``.

``exec`` answers its output as UTF-8 text (undecodable bytes replaced), or with
``"binary": true`` as ``stdout_b64``/``stderr_b64``: the exact bytes, base64.
"""

from __future__ import annotations

import base64
import fcntl
import os
import select
import signal
import subprocess
import time
from typing import Any

from . import pathwalk
from .children import Child, Reaper, child_env, default_cwd
from .protocol import (
    AgentFailure,
    arg_bool,
    arg_command,
    arg_env,
    arg_int,
    arg_path,
    arg_str,
    arg_timeout,
    from_os_error,
    invalid,
)
from .wire import ErrorCode

DEFAULT_MAX_OUTPUT = 1024 * 1024
#: After the child exits, how long to keep reading pipes that its background
#: descendants may hold open.
EXIT_DRAIN_S = 0.1
#: After a timeout kill, how long to wait for the pipes and the exit status.
KILL_GRACE_S = 2.0
_TICK_S = 0.05


class Capture:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        self.dropped += max(0, len(chunk) - max(room, 0))

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def b64(self) -> str:
        """The kept bytes exactly, base64 (no truncation note: see ``truncated``)."""
        return base64.b64encode(bytes(self.data)).decode("ascii")

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.dropped:
            text += f"\n[bunshin: output truncated, {self.dropped} bytes dropped]"
        return text


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _pump(
    child: Child, stdin_data: bytes, out: Capture, err: Capture, timeout: float | None
) -> bool:
    """Feed stdin and drain stdout/stderr until done; return True on timeout."""
    assert child.stdout is not None and child.stderr is not None
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    # select.poll itself, not selectors (Python code each call: see pool.py on why that costs)
    poller = select.poll()
    streams: dict[int, Capture | None] = {child.stdout.fileno(): out, child.stderr.fileno(): err}
    poller.register(child.stdout.fileno(), select.POLLIN)
    poller.register(child.stderr.fileno(), select.POLLIN)
    pending = memoryview(stdin_data)
    if child.stdin is not None:
        fd = child.stdin.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        streams[fd] = None
        poller.register(fd, select.POLLOUT)
    timed_out = False
    stop_at: float | None = None  # when to stop waiting for EOF
    try:
        while streams:
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out = True
                _kill_group(child.pid)
                stop_at = now + KILL_GRACE_S
            if stop_at is None and child.done:
                stop_at = now + EXIT_DRAIN_S
            if stop_at is not None and now >= stop_at:
                break
            # Tick: notice the exit of a child whose pipes a descendant still holds.
            targets = (stop_at,) if timed_out else (deadline, stop_at)
            wait = min([_TICK_S] + [t - now for t in targets if t is not None])
            for fd, _ in poller.poll(max(wait, 0.0) * 1000.0):
                capture = streams[fd]
                if capture is None:  # stdin writable (or its reader gone)
                    try:
                        written = os.write(fd, pending[: 1 << 16])
                    except (BrokenPipeError, BlockingIOError) as exc:
                        written = 0 if isinstance(exc, BlockingIOError) else len(pending)
                    pending = pending[written:]
                    if not pending:
                        poller.unregister(fd)
                        del streams[fd]
                        child.stdin.close()  # type: ignore[union-attr]
                    continue
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    capture.feed(chunk)
                else:
                    poller.unregister(fd)
                    del streams[fd]
    finally:
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None and not stream.closed:
                stream.close()
    if not child.done:
        if deadline is None:
            child.wait()
        elif not timed_out and not child.wait(max(0.0, deadline - time.monotonic())):
            timed_out = True
            _kill_group(child.pid)
        if timed_out:
            child.wait(KILL_GRACE_S)
    return timed_out


def exec_op(reaper: Reaper, req: dict[str, Any]) -> dict[str, Any]:
    argv = arg_command(req)
    env = child_env(arg_env(req))
    cwd = arg_path(req, "cwd", None) or default_cwd(env)
    timeout = arg_timeout(req)
    limit = arg_int(req, "max_output", DEFAULT_MAX_OUTPUT)
    binary = arg_bool(req, "binary", False)  # output as base64 of the exact bytes
    stdin_text = arg_str(req, "stdin", None)
    stdin_data = stdin_text.encode() if stdin_text else b""
    start = time.monotonic()
    child = reaper.start(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.PIPE if stdin_data else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = Capture(limit), Capture(limit)
    try:
        timed_out = _pump(child, stdin_data, out, err, timeout)
    except BaseException:
        _kill_group(child.pid)
        raise
    exit_code = child.exit_code
    output = ({"stdout_b64": out.b64(), "stderr_b64": err.b64()} if binary
              else {"stdout": out.text(), "stderr": err.text()})
    return {
        "exit_code": -signal.SIGKILL if exit_code is None else exit_code,
        "signal": child.signal,
        **output,
        "stdout_truncated": out.truncated,
        "stderr_truncated": err.truncated,
        "timed_out": timed_out,
        "duration_s": time.monotonic() - start,
    }


def spawn_op(reaper: Reaper, req: dict[str, Any]) -> dict[str, Any]:
    argv = arg_command(req)
    env = child_env(arg_env(req))
    cwd = arg_path(req, "cwd", None) or default_cwd(env)
    log_path = arg_path(req, "log_path", None)
    log_fd = None
    if log_path is not None:
        try:
            walked = pathwalk.walk(log_path)  # never into the agent's /proc entries
            try:
                log_fd = walked.reopen(os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            finally:
                walked.close()
        except OSError as exc:
            raise from_os_error(exc, f"log_path {log_path}") from None
    try:
        output = subprocess.DEVNULL if log_fd is None else log_fd
        child = reaper.start(argv, env=env, cwd=cwd, stdout=output, stderr=output)
    finally:
        if log_fd is not None:
            os.close(log_fd)
    return {"pid": child.pid}


def kill_op(req: dict[str, Any]) -> dict[str, Any]:
    pid = arg_int(req, "pid", minimum=2)
    sig = arg_int(req, "signal", int(signal.SIGTERM), minimum=0)
    group = arg_bool(req, "group", False)
    if sig > 64:
        raise invalid(f"invalid signal number {sig}")
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        raise AgentFailure(
            ErrorCode.NOT_FOUND, f"no such process{' group' if group else ''}: {pid}"
        ) from None
    except OSError as exc:
        raise from_os_error(exc, f"kill {pid}") from None
    return {}
