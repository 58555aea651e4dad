"""Wire protocol of the agent: newline-delimited JSON over a unix stream socket.

A request is one JSON object on one line, ``{"op": "...", ...args}``; the answer
is one line, ``{"ok": true, ...}`` or ``{"ok": false, "error": {"code", "message"}}``.
Error codes are those of ``bunshin/errors.py`` (this package may not import it:
it runs inside the workspace with nothing but the standard library).

Also here: the argument readers every handler uses, so that a wrong type or a
missing argument always becomes an ``invalid_argument`` answer.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

VERSION = "1"

#: Largest request line accepted (a base64 ``write_file`` chunk must fit).
MAX_LINE = 64 * 1024 * 1024

INVALID_ARGUMENT = "invalid_argument"
NOT_FOUND = "not_found"
PATH_NOT_FOUND = "path_not_found"
STATE_CONFLICT = "state_conflict"
RESOURCE_EXHAUSTED = "resource_exhausted"
AGENT_ERROR = "agent_error"

OPS = (
    "ping",
    "identify",
    "exec",
    "spawn",
    "kill",
    "read_file",
    "write_file",
    "list_dir",
    "stat",
    "remove",
    "session_open",
    "session_run",
    "session_close",
    "session_list",
    "attach",
    "processes",
    "job_start",
    "job_wait",
)


class AgentFailure(Exception):
    """An error answered to the client as ``{"ok": false, "error": ...}``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def invalid(message: str) -> AgentFailure:
    return AgentFailure(INVALID_ARGUMENT, message)


def from_os_error(exc: OSError, what: str) -> AgentFailure:
    """Translate an ``OSError`` about ``what`` (usually a path) into a wire error."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        return AgentFailure(PATH_NOT_FOUND, f"{what}: no such file or directory")
    if isinstance(exc, NotADirectoryError):
        return invalid(f"{what}: a path component is not a directory")
    if isinstance(exc, IsADirectoryError):
        return invalid(f"{what}: is a directory")
    if isinstance(exc, PermissionError):
        return invalid(f"{what}: permission denied")
    return AgentFailure(AGENT_ERROR, f"{what}: {reason}")


def encode(message: Mapping[str, Any]) -> bytes:
    """One response line. ASCII-escaped so that undecodable file names survive."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def ok(payload: Mapping[str, Any] | None = None) -> bytes:
    return encode({"ok": True, **(payload or {})})


def failure(exc: AgentFailure) -> bytes:
    return encode({"ok": False, "error": exc.to_dict()})


class LineReader:
    """Reads ``\\n``-terminated lines from a socket, keeping what follows in ``buffer``."""

    def __init__(self, sock: socket.socket, limit: int = MAX_LINE) -> None:
        self.sock = sock
        self.limit = limit
        self.buffer = bytearray()

    def readline(self) -> bytes | None:
        """The next line without its newline; ``None`` at a clean end of stream.

        Raises ``AgentFailure`` if the line exceeds the limit or the stream ends
        inside a line.
        """
        start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(self.buffer[:end])
                del self.buffer[: end + 1]
                return line
            if len(self.buffer) > self.limit:
                raise invalid(f"request line longer than {self.limit} bytes")
            start = len(self.buffer)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                if self.buffer:
                    raise invalid("connection closed in the middle of a request")
                return None
            self.buffer += chunk


def parse_request(line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON request: {exc}") from None
    if not isinstance(request, dict):
        raise invalid("a request must be a JSON object")
    op = request.get("op")
    if not isinstance(op, str):
        raise invalid('a request needs an "op" string')
    if op not in OPS:
        raise invalid(f"unknown op {op!r}")
    return request


# --- argument readers -------------------------------------------------------------

_MISSING: Any = object()


def _get(req: Mapping[str, Any], name: str, default: Any) -> Any:
    value = req.get(name, _MISSING)
    if value is None or value is _MISSING:
        if default is _MISSING:
            raise invalid(f"missing argument {name!r}")
        return default
    return value


def arg_str(req: Mapping[str, Any], name: str, default: Any = _MISSING) -> Any:
    value = _get(req, name, default)
    if value is not default and not isinstance(value, str):
        raise invalid(f"argument {name!r} must be a string")
    return value


def arg_bool(req: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = _get(req, name, default)
    if not isinstance(value, bool):
        raise invalid(f"argument {name!r} must be a boolean")
    return value


def arg_int(
    req: Mapping[str, Any], name: str, default: Any = _MISSING, *, minimum: int | None = 0
) -> Any:
    value = _get(req, name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"argument {name!r} must be an integer")
    if minimum is not None and value < minimum:
        raise invalid(f"argument {name!r} must be >= {minimum}")
    return value


def arg_timeout(req: Mapping[str, Any], name: str = "timeout") -> float | None:
    value = _get(req, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise invalid(f"argument {name!r} must be a number of seconds")
    if value <= 0:
        raise invalid(f"argument {name!r} must be > 0")
    return float(value)


def arg_path(req: Mapping[str, Any], name: str = "path", default: Any = _MISSING) -> Any:
    value = arg_str(req, name, default)
    if value is default:
        return value
    if not value.startswith("/"):
        raise invalid(f"argument {name!r} must be an absolute path, got {value!r}")
    if "\0" in value:
        raise invalid(f"argument {name!r} contains a NUL byte")
    return value


def arg_env(req: Mapping[str, Any], name: str = "env") -> dict[str, str]:
    value = _get(req, name, {})
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise invalid(f"argument {name!r} must be an object of string values")
    for key, val in value.items():
        if not key or "=" in key or "\0" in key or "\0" in val:
            raise invalid(f"invalid environment variable {key!r}")
    return value


def arg_command(req: Mapping[str, Any]) -> list[str]:
    """``argv`` (a non-empty list of strings) or ``cmd`` (run by ``/bin/sh -c``)."""
    argv = req.get("argv")
    cmd = req.get("cmd")
    if (argv is None) == (cmd is None):
        raise invalid('give exactly one of "argv" (a list) or "cmd" (a shell string)')
    if cmd is not None:
        if not isinstance(cmd, str):
            raise invalid('argument "cmd" must be a string')
        return ["/bin/sh", "-c", cmd]
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise invalid('argument "argv" must be a non-empty list of strings')
    if not argv[0] or any("\0" in a for a in argv):
        raise invalid('argument "argv" has an empty program or a NUL byte')
    return argv


def unix_address(path: str) -> tuple[str, int | None]:
    """An address usable for ``bind``/``connect`` even past the 108-byte limit.

    Long paths go through an ``O_PATH`` descriptor of the parent directory:
    ``/proc/self/fd/N/name``. The caller closes the returned descriptor.
    """
    if len(os.fsencode(path)) < 108:
        return path, None
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{name}", fd
