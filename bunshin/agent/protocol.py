"""What the agent's handlers share about the wire: the error they raise, the
request parser, and the argument readers.

The wire itself (ops, fields, error codes, framing) is in ``wire``; an
``AgentFailure`` is answered as ``{"ok": false, "error": {"code", "message"}}``
with one of ``wire.ErrorCode`` (each the code of a ``bunshin/errors.py`` class;
this package may not import it: it runs inside the workspace with nothing but
the standard library).

The argument readers check that the argument is one ``wire.SPEC`` declares for
the op, and turn a wrong type or a missing argument into an
``invalid_argument`` answer.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from .wire import OK, OP, SPEC, ErrorCode, decode, error_line, ok_line


class AgentFailure(Exception):
    """An error answered to the client as ``{"ok": false, "error": ...}``."""

    def __init__(self, code: ErrorCode, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)  # ValueError for a code the wire does not know
        self.message = message
        self.hint = hint


def invalid(message: str) -> AgentFailure:
    return AgentFailure(ErrorCode.INVALID_ARGUMENT, message)


def from_os_error(exc: OSError, what: str) -> AgentFailure:
    """Translate an ``OSError`` about ``what`` (usually a path) into a wire error."""
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        return AgentFailure(ErrorCode.PATH_NOT_FOUND, f"{what}: no such file or directory")
    if isinstance(exc, NotADirectoryError):
        return invalid(f"{what}: a path component is not a directory")
    if isinstance(exc, IsADirectoryError):
        return invalid(f"{what}: is a directory")
    if isinstance(exc, PermissionError):
        return invalid(f"{what}: permission denied")
    return AgentFailure(ErrorCode.AGENT_ERROR, f"{what}: {reason}")


def cannot_start(what: str, reason: object) -> AgentFailure:
    """The workspace has no pid left for ``what`` (a thread or a process counts one)."""
    return AgentFailure(
        ErrorCode.RESOURCE_EXHAUSTED, f"cannot start {what}: {reason}",
        hint="the workspace is at its pids limit: end processes or close sessions in it, "
             "or create it with a larger pids limit",
    )


def failure(exc: AgentFailure) -> bytes:
    return error_line(exc.code, exc.message, exc.hint)


def checked(op: str, result: dict[str, Any]) -> bytes:
    """The ok answer line of ``op`` (``agent_error`` for a field ``wire.SPEC`` does not declare
    or a value that is not JSON)."""
    undeclared = result.keys() - SPEC[op].answer  # type: ignore[index]  # a str keys its Op: no Enum call
    if undeclared:
        return failure(AgentFailure(
            ErrorCode.AGENT_ERROR, f"the answer to {op} has fields wire.SPEC does not declare: "
            f"{', '.join(sorted(undeclared))}"))
    try:
        return ok_line(result)
    except (TypeError, ValueError) as exc:
        return failure(AgentFailure(ErrorCode.AGENT_ERROR, f"cannot encode the answer to {op}: {exc}"))


def reply(op: str, call: Callable[[], dict[str, Any]]) -> bytes:
    """The answer line of ``call()`` for ``op``: its fields, or the error it raised
    (any exception but ``AgentFailure`` is an internal error, never the end of the caller)."""
    try:
        return checked(op, call())
    except AgentFailure as exc:
        return failure(exc)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        return failure(AgentFailure(ErrorCode.AGENT_ERROR, f"internal error in {op}: {exc!r}"))


def unline(line: bytes) -> dict[str, Any]:
    """The fields of an answer line a helper sent; its error raised as ``AgentFailure``."""
    try:
        answer = decode(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AgentFailure(ErrorCode.AGENT_ERROR, f"a helper sent a malformed answer: {exc}") from None
    if not isinstance(answer, dict):
        raise AgentFailure(ErrorCode.AGENT_ERROR, "a helper sent an answer that is not an object")
    if answer.get(OK) is True:
        return {k: v for k, v in answer.items() if k != OK}
    error: Any = answer.get("error")
    try:
        hint = error.get("hint")
        raise AgentFailure(ErrorCode(error["code"]), str(error["message"]), hint if isinstance(hint, str) else None)
    except (TypeError, KeyError, ValueError):
        raise AgentFailure(ErrorCode.AGENT_ERROR, f"a helper failed without saying why: {line[:200]!r}") from None


def parse_request(line: bytes) -> dict[str, Any]:
    try:
        request = decode(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"malformed JSON request: {exc}") from None
    if not isinstance(request, dict):
        raise invalid("a request must be a JSON object")
    op = request.get(OP)
    if not isinstance(op, str):
        raise invalid('a request needs an "op" string')
    if op not in SPEC:
        raise invalid(f"unknown op {op!r}")
    return request


# --- argument readers -------------------------------------------------------------

_MISSING: Any = object()


def arg_any(req: Mapping[str, Any], name: str) -> Any:
    """The argument ``name`` as sent (``None`` if absent), once ``wire.SPEC`` declares it."""
    op = req.get(OP)
    if isinstance(op, str) and op in SPEC and name not in SPEC[op].request:  # type: ignore[index]
        raise AgentFailure(
            ErrorCode.AGENT_ERROR, f"the agent reads {name!r}, which {op!r} does not declare (wire.SPEC)"
        )
    return req.get(name)


def _get(req: Mapping[str, Any], name: str, default: Any) -> Any:
    value = arg_any(req, name)
    if value is None:
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
    argv = arg_any(req, "argv")
    cmd = arg_any(req, "cmd")
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
