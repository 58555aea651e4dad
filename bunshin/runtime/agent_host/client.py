"""Host-side client of the in-workspace agent (``bunshin/agent``).

One short-lived unix-socket connection per call, so nothing outside the
workspace holds a connection across a CRIU dump. Answers become the frozen
dataclasses of ``agent_types``. The wire (ops, their arguments and answer
fields, framing, error codes) is ``bunshin.agent.wire``, shared with the agent;
a request the spec does not allow is refused here. Wire errors become the
``bunshin.errors`` class with the same code (``PathNotFound``, ``InvalidArgument``, ``NotFound``,
``StateConflict``...); an unreachable agent or a broken answer is an
``AgentError``. Timeouts of ``exec`` and ``session_run`` are reported in the
result (``timed_out=True``), not raised.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import os
import signal as signals
import socket
import stat
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, overload

from ...agent import wire
from ...agent.wire import JOB_ID, JOB_REQUEST, JOB_RUNNING, JOB_WAIT, OK, RESUMABLE_OPS, SPEC, Op
from ...errors import AgentError, BunshinError, InvalidArgument, PayloadTooLarge, ResourceExhausted
from ..kernel import syscalls
from ..kernel.limits import MAX_FILE_BYTES, MAX_OUTPUT, check_max_output, check_timeout
from .types import (
    AgentInfo,
    ExecResult,
    FileEntry,
    FileType,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)

PathLike = str | os.PathLike[str]

#: Bytes per ``read_file``/``write_file`` request (the agent caps reads at this).
CHUNK = wire.MAX_CHUNK
#: Bytes per request of a whole read: the answer is held ~5 times over while decoded
#: (line, JSON, base64), so pieces of 4 MiB cost the host ~25 MiB at a time, not ~100.
READ_CHUNK = 4 << 20
#: Longest answer line taken from an agent: an exec's two streams of ``MAX_OUTPUT`` bytes,
#: each byte at most 6 when JSON-escaped (``\ufffd`` for an undecodable one), and room to
#: spare. A longer answer (a folder of millions of entries) is an ``AgentError``, not
#: host memory.
MAX_ANSWER = 12 * MAX_OUTPUT + (16 << 20)
#: How much longer than a command's own timeout to wait for the agent's answer
#: (the agent kills, drains and, for sessions, re-synchronises the shell).
ANSWER_GRACE_S = 30.0
_UNIX_PATH_MAX = 108
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (SO_PEERCRED)
#: How long one poll of a resumable op's answer (``wire.RESUMABLE_OPS``) may hold a connection.
POLL_S = 0.25
#: How long to wait for the agent to re-create a socket removed from inside (``_connect``).
REBIND_WAIT_S = 2.0
_SYS_TGKILL = 234  # x86_64


@contextmanager
def call_guard(lock_dir: Path | None) -> Iterator[None]:
    """Shared side of the workspace's call lock: waits while a fork holds it (see ``quiesced``)."""
    if lock_dir is None:
        yield
        return
    try:
        gate = os.open(lock_dir / "gate.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:  # the workspace is gone; the connect will say so
        yield
        return
    try:
        calls = os.open(lock_dir / "calls.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        os.close(gate)
        raise
    try:
        fcntl.flock(gate, fcntl.LOCK_SH)  # a fork holds the gate exclusively: new calls wait here
        fcntl.flock(calls, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        os.close(calls)
        os.close(gate)


@contextmanager
def quiesced(lock_dir: Path) -> Iterator[None]:
    """Exclusive side: no host connection into the workspace is open inside this block.

    Closes the gate to new calls, then waits for in-flight calls (at most one poll
    window of a resumable call, or one short call) to finish.
    """
    lock_dir.mkdir(parents=True, exist_ok=True)
    gate = os.open(lock_dir / "gate.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    calls = os.open(lock_dir / "calls.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(calls, fcntl.LOCK_EX)
        yield
    finally:
        os.close(calls)
        os.close(gate)


class AgentClient:
    """Talks to one agent through its socket. Construction does no I/O."""

    def __init__(
        self,
        socket_path: Path,
        *,
        connect_timeout: float = 5.0,
        call_timeout: float = 60.0,
        lock_dir: Path | None = None,
        beneath: Path | None = None,
        expect_pid: int | None = None,
        rebind: bool = True,
    ) -> None:
        """``beneath``: a host-made folder (a workspace's mounted root) the socket lies
        under; every component below it is one the workspace can write, so it is
        walked without following symlinks (see ``_connect``). ``expect_pid``: host pid
        of the process that must be listening (the workspace's pid 1, the agent);
        a socket anyone else listens on is refused. ``None`` for both (an agent run
        alone, e.g. in tests) connects to the path as given, unchecked. ``rebind``: with
        ``expect_pid``, ask the agent to re-create a socket that cannot be reached (not
        while it starts: ``wait_ready``).
        """
        self.socket_path = Path(socket_path)
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.lock_dir = Path(lock_dir) if lock_dir is not None else None
        self.beneath = Path(beneath) if beneath is not None else None
        self.expect_pid = expect_pid
        self.rebind = rebind
        self._parts: tuple[str, ...] | None = None
        if self.beneath is not None:
            try:
                parts = self.socket_path.relative_to(self.beneath).parts
            except ValueError:
                parts = ()
            if not parts or any(p in (".", "..") for p in parts):
                raise InvalidArgument(f"agent socket {self.socket_path} is not beneath {self.beneath}")
            self._parts = parts

    def __repr__(self) -> str:
        return f"AgentClient({str(self.socket_path)!r})"

    # --- transport ----------------------------------------------------------------

    def call(
        self, op: Op | str, *, answer_timeout: float | None | Literal["default"] = "default", **args: Any
    ) -> dict[str, Any]:
        """Send one request; return the answer's fields (without ``ok``).

        ``answer_timeout``: seconds to wait for the answer (``None``: forever;
        default: ``call_timeout``). Arguments that are ``None`` are left out.
        ``InvalidArgument`` for an op or an argument ``wire.SPEC`` does not know.
        """
        op = str(op)  # an Op's value: messages name 'exec', not <Op.EXEC: 'exec'>
        if op in RESUMABLE_OPS:
            return self._call_resumable(op, None if answer_timeout == "default" else answer_timeout, args)
        return self._decode(op, self._roundtrip(op, _encode(op, args), answer_timeout))

    def _roundtrip(self, op: str, line: bytes, answer_timeout: float | None | Literal["default"],
                   *, resend: bool = False) -> bytes:
        """One connection, one request, one answer line, under the workspace's call lock.

        ``resend``: the request may be sent again if the connection ends without an
        answer (a ``job_wait``: the agent's worker serving it can be killed from inside
        the workspace before it asked the job, e.g. by ``pkill -f``)."""
        deadline = time.monotonic() + self.connect_timeout
        with self._translate(op), call_guard(self.lock_dir):
            while True:
                with self._connect() as sock:
                    sock.settimeout(self.call_timeout if answer_timeout == "default" else answer_timeout)
                    try:
                        sock.sendall(line)
                    except BrokenPipeError:
                        # The agent dropped the connection before reading the request (it could
                        # not start a thread: the workspace is at its pids limit). The request
                        # never arrived, so sending it again is safe.
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                        continue
                    try:
                        return _read_line(sock)
                    except _Dropped:
                        if not resend or time.monotonic() > deadline:
                            raise
                time.sleep(0.05)

    def _call_resumable(self, op: str, answer_timeout: float | None, args: dict[str, Any]) -> dict[str, Any]:
        """Start ``op`` as an agent job and long-poll its answer, one short connection per poll.

        No connection stays open between polls, so the workspace can be forked while
        the command runs (the clone finishes the job on its own).
        """
        inner = {wire.OP: op, **_arguments(op, args)}
        start = _encode(Op.JOB_START.value, {JOB_REQUEST: inner})
        started = self._decode(Op.JOB_START.value, self._roundtrip(op, start, "default"))
        job_id = started[JOB_ID]
        deadline = None if answer_timeout is None else time.monotonic() + answer_timeout
        while True:
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            try:
                poll = _encode(Op.JOB_WAIT.value, {JOB_ID: job_id, JOB_WAIT: wait})
                answer = self._decode(op, self._roundtrip(op, poll, wait + self.call_timeout, resend=True))
            except ResourceExhausted:
                # The workspace is at its pids limit (threads count too): the agent cannot
                # take a new connection now. The job itself runs on; ask again shortly.
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
                continue
            if not answer.get(JOB_RUNNING):
                return answer
            if deadline is not None and time.monotonic() >= deadline:
                raise AgentError(f"agent at {self.socket_path} did not answer {op!r} in time")

    def _connect(self) -> socket.socket:
        """A connected socket to the agent (``_connect_once``). If the socket cannot be
        reached, or someone else listens on it, while the agent lives (a process inside
        removed or replaced it: ``rm /.bunshin/run/agent.sock``), the agent's main thread is
        sent ``wire.REBIND_SIGNAL`` and re-creates it (``AgentServer.heal``); the connection
        is tried again for up to ``REBIND_WAIT_S``. The new socket is checked as any
        (``SO_PEERCRED`` pid 1)."""
        try:
            return self._connect_once()
        except (OSError, AgentError) as exc:
            if isinstance(exc, TimeoutError) or not self.rebind or self.expect_pid is None:
                raise
            try:  # the main thread: it waits in accept(), which the signal interrupts
                syscalls.syscall(_SYS_TGKILL, self.expect_pid, self.expect_pid, int(wire.REBIND_SIGNAL))
            except OSError:
                raise exc from None  # the agent is gone: the first error says it
            first = exc
        deadline = time.monotonic() + REBIND_WAIT_S
        while True:
            time.sleep(0.01)
            try:
                return self._connect_once()
            except (OSError, AgentError) as exc:
                if time.monotonic() < deadline:
                    continue
                raise AgentError(
                    f"agent at {self.socket_path} is not reachable ({_reason(first)}) and did not re-create "
                    f"its socket within {REBIND_WAIT_S:g} s ({_reason(exc)})",
                    hint="a process inside the workspace removed or replaced the agent's socket and the "
                         "agent does not answer: remove the workspace, or restore it from a snapshot",
                ) from None

    def _connect_once(self) -> socket.socket:
        """A connected socket to the agent, checked before a byte is sent.

        With ``beneath``, the socket is reached by a walk of ``O_PATH | O_NOFOLLOW``
        descriptors from that folder (a symlink or non-folder at any component is
        refused, the last one must be a socket: ``fstat`` of what was opened), and
        connected through ``/proc/self/fd/<fd of the socket inode>``: no name is
        looked up again, so nothing the workspace swaps in meanwhile is followed.
        With ``expect_pid``, the listener's ``SO_PEERCRED`` must be that pid: a
        process inside that deletes the agent's socket and binds its own there (or
        any host socket reached some other way) is refused with ``AgentError``.

        SO_PEERCRED of a connection to a listening unix socket reports the process
        that called ``listen()``, translated into the caller's pid namespace. After a
        CRIU restore (a forked clone, or a clone of a clone) it reports the clone's pid
        1 host pid, the same as the restored workspace's record (``rec.pid``): CRIU
        re-creates and re-listens each socket in the restored task that owns it
        (checked on CRIU 4.2.1, ``tests/security/test_host_paths.py``). Cost: three to
        four ``openat``, one ``fstat`` and one ``getsockopt`` more than a plain
        connect, about 4 us.
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.connect_timeout)
            if self._parts is not None and self.beneath is not None:
                fd = _open_socket_beneath(self.beneath, self._parts, self.socket_path)
                try:
                    sock.connect(f"/proc/self/fd/{fd}")
                finally:
                    os.close(fd)
            else:
                path = os.fspath(self.socket_path)
                if len(os.fsencode(path)) < _UNIX_PATH_MAX:
                    sock.connect(path)
                else:  # too long for sockaddr_un: go through an O_PATH fd of the directory
                    dir_fd = os.open(self.socket_path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        sock.connect(f"/proc/self/fd/{dir_fd}/{self.socket_path.name}")
                    finally:
                        os.close(dir_fd)
            if self.expect_pid is not None:
                pid, _uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                if pid != self.expect_pid:
                    raise AgentError(
                        f"the socket at {self.socket_path} is not the workspace agent's: pid {pid} listens "
                        f"on it, the agent is pid {self.expect_pid}; refusing to talk to it",
                        hint="a process inside the workspace replaced the agent's socket",
                    )
        except BaseException:
            sock.close()
            raise
        return sock

    @contextmanager
    def _translate(self, op: str) -> Iterator[None]:
        """The one place where socket and JSON errors become ``AgentError``."""
        where = f"agent at {self.socket_path}"
        try:
            yield
        except BunshinError:
            raise
        except TimeoutError:
            raise AgentError(f"{where} did not answer {op!r} in time") from None
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise AgentError(
                f"{where} is not reachable ({exc.strerror or exc})",
                hint="is the workspace running?",
            ) from None
        except OSError as exc:
            raise AgentError(f"{where}: {op!r} failed: {exc.strerror or exc}") from None

    def _decode(self, op: str, raw: bytes) -> dict[str, Any]:
        try:
            answer = wire.decode(raw)
        except ValueError:
            raise AgentError(
                f"agent at {self.socket_path} sent a malformed answer to {op!r}"
            ) from None
        if not isinstance(answer, dict) or not isinstance(answer.get(OK), bool):
            raise AgentError(f"agent at {self.socket_path} sent an unexpected answer to {op!r}")
        if not answer.pop(OK):
            error = answer.get(wire.ERROR)
            if not isinstance(error, dict):
                raise AgentError(f"agent at {self.socket_path} failed {op!r} without saying why")
            raise BunshinError.from_dict(error)
        return _Answer(op, answer)

    # --- liveness and identity -------------------------------------------------------

    def ping(self) -> AgentInfo:
        a = self.call(Op.PING)
        return AgentInfo(
            pid=a["pid"],
            version=a["version"],
            uptime_s=a["uptime_s"],
            identity=a.get("identity") or {},
        )

    def wait_ready(self, timeout: float = 10.0) -> AgentInfo:
        """Poll ``ping`` until the agent answers; ``AgentError`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            left = max(deadline - time.monotonic(), 0.05)
            probe = AgentClient(
                self.socket_path,
                connect_timeout=min(self.connect_timeout, left),
                call_timeout=min(self.call_timeout, left),
                beneath=self.beneath,
                expect_pid=self.expect_pid,
                rebind=False,  # the agent may not listen yet
            )
            try:
                return probe.ping()
            except AgentError as exc:
                if time.monotonic() + delay > deadline:
                    raise AgentError(
                        f"agent at {self.socket_path} not ready after {timeout:g} s: {exc.message}",
                        hint="see the workspace's agent log",
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def identify(self, identity: Mapping[str, Any]) -> None:
        """Tell the agent who it is (e.g. after a fork: ``{"fork_id": ...}``)."""
        self.call(Op.IDENTIFY, identity=dict(identity))

    # --- processes --------------------------------------------------------------------

    @overload
    def exec(
        self,
        argv: Sequence[str] | None = None,
        *,
        cmd: str | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        stdin: str | None = None,
        text: Literal[True] = True,
    ) -> ExecResult[str]: ...

    @overload
    def exec(
        self,
        argv: Sequence[str] | None = None,
        *,
        cmd: str | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        stdin: str | None = None,
        text: Literal[False],
    ) -> ExecResult[bytes]: ...

    @overload
    def exec(
        self,
        argv: Sequence[str] | None = None,
        *,
        cmd: str | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]: ...

    def exec(
        self,
        argv: Sequence[str] | None = None,
        *,
        cmd: str | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
        stdin: str | None = None,
        text: bool = True,
    ) -> ExecResult[str] | ExecResult[bytes]:
        """Run ``argv`` (or ``cmd`` via ``/bin/sh -c``) to completion and capture its output.

        ``text=False``: ``stdout``/``stderr`` are the exact bytes written (base64 on the wire).
        """
        check_timeout(timeout)
        check_max_output(max_output)
        a = self.call(
            Op.EXEC,
            answer_timeout=None if timeout is None else timeout + ANSWER_GRACE_S,
            **_command(argv, cmd),
            cwd=_path(cwd),
            env=dict(env) if env is not None else None,
            timeout=timeout,
            max_output=max_output,
            stdin=stdin,
            binary=None if text else True,  # left out in text mode: older agents understand it
        )
        status = (a["exit_code"], a["signal"])
        flags = (a["stdout_truncated"], a["stderr_truncated"], a["timed_out"], a["duration_s"])
        if text:
            return ExecResult[str](*status, a["stdout"], a["stderr"], *flags)
        try:
            out, err = base64.b64decode(a["stdout_b64"]), base64.b64decode(a["stderr_b64"])
        except (TypeError, ValueError):
            raise AgentError(f"agent at {self.socket_path} sent malformed base64 output") from None
        return ExecResult[bytes](*status, out, err, *flags)

    def spawn(
        self,
        argv: Sequence[str] | None = None,
        *,
        cmd: str | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        log_path: PathLike | None = None,
    ) -> int:
        """Start a background process in its own session; returns its pid."""
        a = self.call(
            Op.SPAWN,
            **_command(argv, cmd),
            cwd=_path(cwd),
            env=dict(env) if env is not None else None,
            log_path=_path(log_path),
        )
        return int(a["pid"])

    def kill(self, pid: int, signal: int = signals.SIGTERM, *, group: bool = False) -> None:
        """Send ``signal`` to a process (or its process group); ``NotFound`` if gone."""
        self.call(Op.KILL, pid=pid, signal=int(signal), group=group)

    def processes(self) -> list[ProcessInfo]:
        return [
            ProcessInfo(
                pid=p["pid"],
                ppid=p["ppid"],
                pgid=p["pgid"],
                sid=p["sid"],
                state=p["state"],
                name=p["name"],
                cmdline=tuple(p["cmdline"]),
            )
            for p in self.call(Op.PROCESSES)["processes"]
        ]

    # --- files ------------------------------------------------------------------------

    def read_file(self, path: PathLike, *, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes of a regular file from ``offset``: ``length`` of them, or up to the end (a file
        larger than ``MAX_FILE_BYTES`` from ``offset`` is refused before more than a chunk is read)."""
        return b"".join(self.iter_file(path, offset=offset, length=length, chunk=READ_CHUNK))

    def iter_file(self, path: PathLike, *, offset: int = 0, length: int | None = None,
                  chunk: int = CHUNK) -> Iterator[bytes]:
        """The bytes :meth:`read_file` answers, in pieces of at most ``chunk``: the host holds
        one piece at a time. Without ``length``, ``PayloadTooLarge`` (raised by the first
        piece) when the file holds more than ``MAX_FILE_BYTES`` past ``offset``; a file that
        grows while read ends at the size it had then."""
        _check_span(offset, length)
        chunk = max(1, min(chunk, CHUNK))
        got, end = 0, length
        while end is None or got < end:
            want = chunk if end is None else min(chunk, end - got)
            a = self.call(Op.READ_FILE, path=_path(path), offset=offset + got, length=want)
            if end is None:
                end = max(int(a["size"]) - offset, 0)
                if end > MAX_FILE_BYTES:
                    raise PayloadTooLarge(
                        f"{path} holds {end} bytes past offset {offset}: over the {MAX_FILE_BYTES >> 20} MiB "
                        "one whole read takes", hint="read it in parts (offset and length)", size=end)
            try:
                data = base64.b64decode(a["data_b64"])
            except (TypeError, ValueError):
                raise AgentError(f"agent at {self.socket_path} sent malformed base64 file data") from None
            data = data[: want]  # never more than asked, whatever the agent says
            got += len(data)
            if data:
                yield data
            if a.get("eof") or len(data) < want:
                return

    def write_file(
        self,
        path: PathLike,
        data: bytes | str,
        *,
        mode: int | None = None,
        append: bool = False,
        mkdirs: bool = False,
    ) -> int:
        """Write (or append) ``data``; returns the file's size afterwards."""
        raw = memoryview(data.encode() if isinstance(data, str) else data)
        return self.write_stream(path, (raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK)), mode=mode,
                                 append=append, mkdirs=mkdirs)

    def write_stream(
        self,
        path: PathLike,
        pieces: Iterable[bytes | memoryview],
        *,
        mode: int | None = None,
        append: bool = False,
        mkdirs: bool = False,
    ) -> int:
        """Write (or append) the bytes of ``pieces`` as they come, a chunk at a time (the host
        holds one piece); returns the file's size afterwards. The file is truncated by the
        first write, so a source that fails midway leaves what came before it."""
        size, first = None, True
        for piece in pieces:
            view = memoryview(piece)
            for i in range(0, len(view), CHUNK):
                size = self._write_chunk(path, view[i : i + CHUNK], mode, append or not first, mkdirs)
                first = False
        return size if size is not None else self._write_chunk(path, b"", mode, append, mkdirs)

    def _write_chunk(self, path: PathLike, chunk: bytes | memoryview, mode: int | None, append: bool,
                     mkdirs: bool) -> int:
        a = self.call(Op.WRITE_FILE, path=_path(path), data_b64=base64.b64encode(chunk).decode(), mode=mode,
                      append=append, mkdirs=mkdirs)
        return int(a["size"])

    def list_dir(self, path: PathLike) -> list[FileEntry]:
        return [_entry(e) for e in self.call(Op.LIST_DIR, path=_path(path))["entries"]]

    def stat(self, path: PathLike) -> FileEntry:
        return _entry(self.call(Op.STAT, path=_path(path)))

    def remove(self, path: PathLike, *, recursive: bool = False) -> None:
        self.call(Op.REMOVE, path=_path(path), recursive=recursive)

    # --- sessions ---------------------------------------------------------------------

    def session_open(
        self,
        kind: str = "bash",
        *,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Open a persistent shell (bash, or sh if the image has none); returns its id."""
        a = self.call(
            Op.SESSION_OPEN, kind=kind, cwd=_path(cwd), env=dict(env) if env is not None else None
        )
        return str(a["session_id"])

    def session_run(
        self,
        session_id: str,
        command: str,
        *,
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> SessionResult:
        """Run ``command`` in the session's shell; state carries over between runs."""
        check_max_output(max_output)
        a = self.call(
            Op.SESSION_RUN,
            answer_timeout=None if timeout is None else timeout + ANSWER_GRACE_S,
            session_id=session_id,
            command=command,
            timeout=timeout,
            max_output=max_output,
        )
        return SessionResult(
            output=a["output"],
            exit_code=a["exit_code"],
            timed_out=a["timed_out"],
            truncated=a["truncated"],
            duration_s=a["duration_s"],
            alive=a.get("alive", True),
        )

    def session_close(self, session_id: str) -> None:
        self.call(Op.SESSION_CLOSE, session_id=session_id)

    def session_list(self) -> list[SessionInfo]:
        return [
            SessionInfo(
                session_id=s["session_id"],
                kind=s["kind"],
                pid=s["pid"],
                busy=s["busy"],
                alive=s.get("alive", True),
            )
            for s in self.call(Op.SESSION_LIST)["sessions"]
        ]

    def trim(self) -> int:
        """End the agent's waiting threads (before a fork's freeze: CRIU dumps every thread
        inside the pause); how many threads the agent has once they have ended."""
        return int(self.call(Op.TRIM)["threads"])

    def attach(
        self,
        kind: str = "bash",
        *,
        rows: int | None = None,
        cols: int | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
    ) -> socket.socket:
        """A new interactive shell on a new pty; returns the connected socket.

        After the agent's ``ok`` the socket is a raw byte pipe to the pty, both
        ways, until either side closes it. The caller owns (and closes) it.
        """
        op = Op.ATTACH.value
        line = _encode(
            op,
            {
                "kind": kind,
                "rows": rows,
                "cols": cols,
                "cwd": _path(cwd),
                "env": dict(env) if env is not None else None,
            },
        )
        with self._translate(op):
            sock = self._connect()
            try:
                sock.settimeout(self.call_timeout)
                sock.sendall(line)
                # byte by byte: what follows the answer is the pty's
                reader = wire.LineReader(lambda _n: sock.recv(1), limit=1 << 16)
                try:
                    raw = reader.readline()
                except wire.FramingError:
                    raw = None
                if raw is None:
                    raise AgentError(f"agent at {self.socket_path} closed the attach connection")
                self._decode(op, raw)
                sock.settimeout(None)
                return sock
            except BaseException:
                sock.close()
                raise


class _Answer(dict[str, Any]):
    """An answer's fields; a missing one means the agent speaks another protocol."""

    def __init__(self, op: str, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.op = op

    def __missing__(self, key: str) -> Any:
        spec = SPEC.get(Op(self.op)) if self.op in SPEC else None
        if spec is not None and key not in spec.answer:
            raise AgentError(f"the client reads {key!r}, which the answer to {self.op!r} does not "
                             "declare (bunshin/agent/wire.py)")
        raise AgentError(f"the agent's answer to {self.op!r} lacks {key!r}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, AgentError):
        return exc.message
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _open_socket_beneath(top: Path, parts: Sequence[str], where: Path) -> int:
    """An ``O_PATH`` descriptor of the socket at ``top/parts...``, never through a symlink."""
    fd = os.open(top, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise AgentError(f"refusing the agent socket {where}: {part!r} on its path is not a folder "
                                     "(symlinks the workspace made are not followed)") from None
                raise
            os.close(fd)
            fd = child
        sfd = os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISSOCK(os.fstat(sfd).st_mode):
        os.close(sfd)
        raise AgentError(f"refusing the agent socket {where}: it is not a socket "
                         "(symlinks the workspace made are not followed)")
    return sfd


def _arguments(op: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` without the ``None`` ones, each one ``op`` takes (``InvalidArgument`` if not)."""
    if op not in SPEC:
        raise InvalidArgument(f"unknown op {op!r}")
    given = {k: v for k, v in args.items() if v is not None}
    unknown = given.keys() - SPEC[Op(op)].request
    if unknown:
        raise InvalidArgument(f"{op!r} takes no argument {', '.join(map(repr, sorted(unknown)))}")
    return given


def _encode(op: str, args: Mapping[str, Any]) -> bytes:
    try:
        return wire.request_line(op, _arguments(op, args))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidArgument):
            raise
        raise InvalidArgument(f"cannot send {op!r}: {exc}") from None


class _Dropped(ConnectionResetError):
    """The agent's side closed the connection without answering."""


def _read_line(sock: socket.socket) -> bytes:
    """One answer line (at most ``MAX_ANSWER`` bytes); ``_Dropped`` if the agent closes first."""
    try:
        line = wire.LineReader(sock.recv, limit=MAX_ANSWER).readline()
    except wire.LineTooLong:
        raise AgentError(f"the agent's answer is longer than {MAX_ANSWER} bytes: refused",
                         hint="ask for less (a folder in parts, output into a file)") from None
    except wire.LineCut:
        line = None
    if line is None:
        raise _Dropped("the agent closed the connection without answering")
    return line


def _check_span(offset: int, length: int | None) -> None:
    """``InvalidArgument`` unless ``offset`` is a file offset and ``length`` a count of bytes."""
    for name, v in (("offset", offset), ("length", length)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 62):
            raise InvalidArgument(f"{name} {v!r} is not a byte count", hint="give a whole number >= 0")


def _command(argv: Sequence[str] | None, cmd: str | None) -> dict[str, Any]:
    if (argv is None) == (cmd is None):
        raise InvalidArgument("give exactly one of argv (a list) or cmd (a shell string)")
    if isinstance(argv, str):
        raise InvalidArgument("argv must be a list of strings; pass a shell string as cmd=")
    return {"argv": list(argv)} if argv is not None else {"cmd": cmd}


def _path(path: PathLike | None) -> str | None:
    return None if path is None else os.fspath(path)


def _entry(e: dict[str, Any]) -> FileEntry:
    return FileEntry(
        name=e["name"],
        type=FileType(e["type"]),
        size=e["size"],
        mode=e["mode"],
        mtime=e["mtime"],
        link_target=e.get("link_target"),
    )
