"""The bunshin error tree.

Every error bunshin raises is a ``BunshinError``. Each class carries a stable
``code`` (survives the wire: ``to_dict``/``from_dict``, ``error_class(code)``) and
an HTTP status; each instance a ``hint`` saying what to do (given where it is
raised). Where a built-in exception fits, the error inherits it too, so
``except TimeoutError`` and ``except FileNotFoundError`` work as expected. The
tree below is checked against the classes by ``tests/test_errors.py``::

    BunshinError
    ├── InvalidArgument (ValueError)            400 bad input: size, count, name, spec
    │   ├── ToolError                           a tool-level failure: the call's observation, not a crash
    │   ├── PayloadTooLarge                     413 a body (sent, or a whole file asked for) over its limit
    │   └── IdempotencyKeyReused                422 an Idempotency-Key sent again with another request
    ├── NotFound (LookupError)                  404
    │   ├── WorkspaceNotFound
    │   ├── SnapshotNotFound
    │   ├── ImageNotFound
    │   └── PathNotFound (FileNotFoundError)    a path inside a workspace
    ├── Unauthorized (PermissionError)          401 no or a wrong API token
    ├── StateConflict                           409 e.g. exec into a stopped workspace
    │   ├── NotForkable                         the workspace holds something that cannot be forked safely
    │   └── RequestInProgress                   the first call with this Idempotency-Key is still running
    ├── ToolTimeout (TimeoutError)              504 a command ran past its timeout
    ├── ResourceExhausted                       507 tmpfs full, limits hit
    │   └── RateLimited                         429 a host cap or the create/fork rate: retry after retry_after s
    ├── AgentError                              502 the in-workspace agent failed or vanished
    ├── Unreachable (ConnectionError)           503 the bunshin server did not answer
    ├── PolicyError                             502 a policy (model endpoint, trace) failed
    ├── HostUnsupported                         500 the machine cannot run workspaces (see doctor)
    └── RuntimeFailure                          500 a kernel/CRIU/cgroup step failed
        ├── CriuError                           carries CRIU's log tail
        └── SetupFailed                         a task's setup command failed

Foreign errors (OSError from mount/cgroup files, CRIU exit codes) are translated
into these at the runtime boundary; nothing else escapes the public API.
"""

from __future__ import annotations

from typing import Any, ClassVar


class BunshinError(Exception):
    """Base of every bunshin error."""

    code: ClassVar[str] = "bunshin_error"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def to_dict(self) -> dict[str, Any]:
        """The wire form: enough to rebuild the same error on the other side."""
        return {"code": self.code, "message": self.message, "hint": self.hint, "details": self.details}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> BunshinError:
        cls = error_class(data.get("code", ""))
        return cls(data.get("message", ""), hint=data.get("hint"), **(data.get("details") or {}))


class InvalidArgument(BunshinError, ValueError):
    code = "invalid_argument"
    http_status = 400


class ToolError(InvalidArgument):
    """A tool-level failure (bad arguments, no such file, edit text not unique): it
    becomes the call's observation, never a crash."""

    code = "tool_error"


class PayloadTooLarge(InvalidArgument):
    """A body over the limit for it: a request body the server takes, or a file read whole."""

    code = "payload_too_large"
    http_status = 413


class IdempotencyKeyReused(InvalidArgument):
    """An ``Idempotency-Key`` already used for a different request (method, path or body)."""

    code = "idempotency_key_reused"
    http_status = 422


class NotFound(BunshinError, LookupError):
    code = "not_found"
    http_status = 404


class WorkspaceNotFound(NotFound):
    code = "workspace_not_found"


class SnapshotNotFound(NotFound):
    code = "snapshot_not_found"


class ImageNotFound(NotFound):
    code = "image_not_found"


class PathNotFound(NotFound, FileNotFoundError):
    code = "path_not_found"


class Unauthorized(BunshinError, PermissionError):
    code = "unauthorized"
    http_status = 401


class StateConflict(BunshinError):
    code = "state_conflict"
    http_status = 409


class NotForkable(StateConflict):
    """A copy-on-write fork would change the program's semantics (e.g. an allocator relying on zero-fill)."""

    code = "not_forkable"


class RequestInProgress(StateConflict):
    """The first call with this ``Idempotency-Key`` has not answered yet: retry after
    ``retry_after`` seconds to get its answer."""

    code = "request_in_progress"


class ToolTimeout(BunshinError, TimeoutError):
    code = "timeout"
    http_status = 504


class ResourceExhausted(BunshinError):
    code = "resource_exhausted"
    http_status = 507


class RateLimited(ResourceExhausted):
    """Admission control said not now: a host cap (workspaces, memory) or the create/fork
    rate. ``retry_after``: seconds to wait (also the answer's ``Retry-After``)."""

    code = "rate_limited"
    http_status = 429


class AgentError(BunshinError):
    code = "agent_error"
    http_status = 502


class Unreachable(BunshinError, ConnectionError):
    code = "unreachable"
    http_status = 503


class PolicyError(BunshinError):
    """The policy could not decide a turn: the model endpoint failed, a trace ran out."""

    code = "policy_error"
    http_status = 502


class HostUnsupported(BunshinError):
    code = "host_unsupported"
    http_status = 500


class RuntimeFailure(BunshinError):
    code = "runtime_failure"
    http_status = 500


class CriuError(RuntimeFailure):
    """CRIU failed; ``first_errors`` holds its first real error lines, ``log_tail`` the
    last lines of its log, ``details["log"]`` the log's path."""

    code = "criu_error"

    def __init__(self, message: str, *, hint: str | None = None, log_tail: str = "", first_errors: str = "",
                 **details: Any) -> None:
        super().__init__(message, hint=hint, log_tail=log_tail, first_errors=first_errors, **details)
        self.log_tail = log_tail
        self.first_errors = first_errors

    def __str__(self) -> str:
        out = super().__str__()
        if self.first_errors:
            out += f"\n--- criu's first errors ---\n{self.first_errors}"
        if self.log_tail:
            log = self.details.get("log")
            out += f"\n--- criu log tail{f' ({log})' if log else ''} ---\n{self.log_tail}"
        return out


class SetupFailed(RuntimeFailure):
    """A task's setup command exited non-zero or timed out."""

    code = "setup_failed"


def _all_subclasses(cls: type[BunshinError]) -> list[type[BunshinError]]:
    out: list[type[BunshinError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_class(code: str) -> type[BunshinError]:
    """The class whose ``code`` this is; ``BunshinError`` for a code nobody defines."""
    return _BY_CODE.get(code, BunshinError)


_BY_CODE: dict[str, type[BunshinError]] = {c.code: c for c in _all_subclasses(BunshinError)}
_BY_CODE[BunshinError.code] = BunshinError
