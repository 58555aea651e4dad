"""The agent's wire protocol, written once for both ends.

The agent (``server``, ``jobs`` and the op handlers) and the host client
(``bunshin.runtime.agent_host.client``) both import this module; nothing about the
wire is spelled anywhere else. Standard library only: it ships into every
workspace with the rest of the agent package.

Framing: one JSON object per ``\\n``-terminated line over a unix stream socket,
ASCII-escaped (so undecodable file names survive). A connection carries
sequential requests, each answered by one line::

    request   {"op": "<Op>", ...arguments}          (arguments that are null are left out)
    answer    {"ok": true, ...fields}
              {"ok": false, "error": {"code": "<ErrorCode>", "message": "..."}}

``SPEC`` lists, per op, the arguments the agent reads and the fields an ok
answer may carry. Both ends hold to it at run time: the client refuses to send
an argument the op does not take, the agent answers ``agent_error`` if a handler
reads an undeclared argument or answers an undeclared field, and a field the
client reads that is not in the answer is an ``AgentError``.

Long ops (``exec``, ``session_run``: ``RESUMABLE_OPS``) run as jobs: ``job_start``
with the inner request, then ``job_wait`` long-polls of at most ``MAX_WAIT_S``
each, so no host connection stays open across a fork (see ``jobs``). After an
ok answer to ``attach`` the connection is a raw byte pipe to a pty.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, NamedTuple

#: Protocol version, answered by ``ping``.
VERSION = "1"

#: Largest request line the agent accepts (a base64 ``write_file`` chunk must fit).
MAX_LINE = 64 * 1024 * 1024
#: Most file bytes one ``read_file`` answers, and the client's ``write_file`` chunk.
MAX_CHUNK = 16 * 1024 * 1024
#: Longest one ``job_wait`` holds its connection, whatever ``wait`` asks.
MAX_WAIT_S = 5.0
#: The host sends it to the agent's main thread when the agent's socket cannot be reached
#: (removed or replaced from inside): the agent re-creates it (``AgentServer.heal``). As pid 1
#: the agent takes it from processes inside too: it only makes the agent check its socket.
REBIND_SIGNAL = signal.SIGHUP

# Envelope fields.
OP = "op"
OK = "ok"
ERROR = "error"
CODE = "code"
MESSAGE = "message"
HINT = "hint"  # optional: what to do (``bunshin.errors``' hint)
# Fields of the job ops (and the only answer field of a job still running).
JOB_REQUEST = "request"
JOB_ID = "job_id"
JOB_WAIT = "wait"
JOB_RUNNING = "running"


class Op(StrEnum):
    PING = "ping"
    IDENTIFY = "identify"
    EXEC = "exec"
    SPAWN = "spawn"
    KILL = "kill"
    READ_FILE = "read_file"
    WRITE_FILE = "write_file"
    LIST_DIR = "list_dir"
    STAT = "stat"
    REMOVE = "remove"
    SESSION_OPEN = "session_open"
    SESSION_RUN = "session_run"
    SESSION_CLOSE = "session_close"
    SESSION_LIST = "session_list"
    ATTACH = "attach"
    PROCESSES = "processes"
    JOB_START = "job_start"
    JOB_WAIT = "job_wait"
    TRIM = "trim"


class ErrorCode(StrEnum):
    """Every code the agent answers; each is the ``code`` of a ``bunshin.errors`` class."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    PATH_NOT_FOUND = "path_not_found"
    STATE_CONFLICT = "state_conflict"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    AGENT_ERROR = "agent_error"


class FileType(StrEnum):
    """The ``type`` of a ``stat`` answer or a ``list_dir`` entry (symlinks are not followed)."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    OTHER = "other"


class OpSpec(NamedTuple):  # not a dataclass: ``dataclasses`` imports ``inspect`` and ``_opcode``
    """What one op takes and answers (``answer``: fields an ok answer may carry)."""

    request: frozenset[str]
    answer: frozenset[str]
    resumable: bool = False


def _spec(request: str, answer: str, *, resumable: bool = False) -> OpSpec:
    return OpSpec(frozenset(request.split()), frozenset(answer.split()), resumable)


#: Fields of a ``stat`` answer and of each ``list_dir`` entry (``link_target``: symlinks only).
ENTRY_FIELDS = frozenset("name type size mode mtime link_target".split())
#: Fields of each ``processes`` item.
PROCESS_FIELDS = frozenset("pid ppid pgid sid state name cmdline".split())
#: Fields of each ``session_list`` item.
SESSION_FIELDS = frozenset("session_id kind pid busy alive".split())
_COMMAND = "argv cmd cwd env"  # argv (a list) or cmd (run by /bin/sh -c)

SPEC: dict[Op, OpSpec] = {
    Op.PING: _spec("", "pid version uptime_s identity"),
    Op.IDENTIFY: _spec("identity", ""),
    Op.EXEC: _spec(
        f"{_COMMAND} timeout max_output stdin binary",
        "exit_code signal stdout stderr stdout_b64 stderr_b64 stdout_truncated "
        "stderr_truncated timed_out duration_s",
        resumable=True,
    ),
    Op.SPAWN: _spec(f"{_COMMAND} log_path", "pid"),
    Op.KILL: _spec("pid signal group", ""),
    Op.READ_FILE: _spec("path offset length", "data_b64 size eof"),
    Op.WRITE_FILE: _spec("path data_b64 mode append mkdirs", "size"),
    Op.LIST_DIR: _spec("path", "entries"),
    Op.STAT: OpSpec(frozenset({"path"}), ENTRY_FIELDS),
    Op.REMOVE: _spec("path recursive", ""),
    Op.SESSION_OPEN: _spec("kind cwd env", "session_id kind pid"),
    Op.SESSION_RUN: _spec(
        "session_id command timeout max_output",
        "output exit_code timed_out truncated duration_s alive",
        resumable=True,
    ),
    Op.SESSION_CLOSE: _spec("session_id", ""),
    Op.SESSION_LIST: _spec("", "sessions"),
    Op.ATTACH: _spec("kind rows cols cwd env", ""),
    Op.PROCESSES: _spec("", "processes"),
    Op.JOB_START: _spec(JOB_REQUEST, JOB_ID),
    # The answer of a finished job is the inner op's answer.
    Op.JOB_WAIT: _spec(f"{JOB_ID} {JOB_WAIT}", JOB_RUNNING),
    # Before a fork: the agent's waiting threads end (``pool.Pool.trim``); ``threads``: how
    # many the agent has once they and the thread answering have ended.
    Op.TRIM: _spec("", "threads"),
}

RESUMABLE_OPS = tuple(op for op, spec in SPEC.items() if spec.resumable)


# --- encoding -----------------------------------------------------------------------


def encode(message: Mapping[str, Any]) -> bytes:
    """One line: compact, ASCII-escaped JSON and ``\\n``. ``TypeError``/``ValueError``
    if ``message`` is not JSON."""
    return _ENCODER.encode(message).encode() + b"\n"


#: One encoder for every line (``json.dumps`` with separators builds one per call: Python
#: code each object of which a clone's first call would copy).
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def request_line(op: str, args: Mapping[str, Any]) -> bytes:
    """A request line; arguments that are ``None`` are left out."""
    return encode({OP: op, **{k: v for k, v in args.items() if v is not None}})


def ok_line(fields: Mapping[str, Any] | None = None) -> bytes:
    return encode({OK: True, **(fields or {})})


def error_line(code: ErrorCode, message: str, hint: str | None = None) -> bytes:
    error = {CODE: str(code), MESSAGE: message}
    if hint is not None:
        error[HINT] = hint
    return encode({OK: False, ERROR: error})


def decode(line: bytes) -> Any:
    """The JSON value of one line (without its newline); ``ValueError`` if it is none
    (``UnicodeDecodeError`` is one)."""
    return json.loads(line.decode("utf-8", "surrogatepass"))  # str: no encoding detection


# --- framing ------------------------------------------------------------------------


class FramingError(ValueError):
    """No line could be read: it is longer than the limit, or the stream ended inside it."""


class LineTooLong(FramingError):
    pass


class LineCut(FramingError):
    pass


class LineReader:
    """Reads ``\\n``-terminated lines from ``recv``, keeping what follows in ``buffer``.

    ``recv(n)`` returns up to ``n`` bytes, ``b""`` at the end of the stream (a
    socket's ``recv``). ``limit``: longest line accepted (``None``: no limit).
    """

    def __init__(self, recv: Callable[[int], bytes], limit: int | None = MAX_LINE) -> None:
        self.recv = recv
        self.limit = limit
        self.buffer = bytearray()

    def readline(self) -> bytes | None:
        """The next line without its newline; ``None`` at a clean end of stream.

        ``LineTooLong`` past the limit, ``LineCut`` if the stream ends inside a line.
        """
        start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                return line
            if self.limit is not None and len(self.buffer) > self.limit:
                raise LineTooLong(f"line longer than {self.limit} bytes")
            start = len(self.buffer)
            chunk = self.recv(1 << 20)
            if not chunk:
                if self.buffer:
                    raise LineCut("the stream ended in the middle of a line")
                return None
            self.buffer += chunk
