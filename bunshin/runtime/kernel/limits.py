"""Bounds on what a caller may ask for, checked where a request enters (one place)."""

from __future__ import annotations

import math
import os

from ...errors import InvalidArgument

#: Longest timeout a command, a session run or a tool call may ask for: 7 days.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: Timeout of a one-shot command (``exec``, ``commands.run``) given none: 10 minutes. A
#: command that runs past it is killed like one past its own timeout (``timed_out``; the
#: CLI exits 124); ask for more per call, up to :data:`MAX_TIMEOUT_S`.
DEFAULT_EXEC_TIMEOUT_S = 600.0
#: Most bytes of output (each of stdout and stderr) one command or session run may ask to
#: keep (``max_output``; the agent's default is 1 MiB). The answer holds them JSON-escaped
#: (up to 6 bytes each) and the host holds the answer whole: larger output goes to a file,
#: read in parts.
MAX_OUTPUT = 16 << 20
#: Largest file read or written whole in one call (``Files.read`` without a ``length``, the
#: server's file bodies, SWE-ReX uploads and the members a zip unpacks to).
MAX_FILE_BYTES = 1 << 30
#: Largest file held whole as text in one JSON answer or one edit (SWE-ReX's ``read_file``,
#: the ``edit`` tool): JSON escapes make it up to 6 times larger on the wire.
MAX_TEXT_FILE_BYTES = 16 << 20


def check_timeout(timeout: float | None, what: str = "timeout") -> float | None:
    """``timeout`` as seconds, or ``InvalidArgument`` unless it is finite, > 0 and at most
    :data:`MAX_TIMEOUT_S` (``None``: no timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT_S:
        raise InvalidArgument(
            f"{what} {timeout!r} is out of range",
            hint=f"give a finite number of seconds > 0 and <= {MAX_TIMEOUT_S:g} (7 days), or no timeout",
        )
    return float(timeout)


def exec_timeout(timeout: float | None) -> float:
    """A one-shot command's timeout: ``timeout`` checked, or :data:`DEFAULT_EXEC_TIMEOUT_S`."""
    checked = check_timeout(timeout)
    return DEFAULT_EXEC_TIMEOUT_S if checked is None else checked


def check_max_output(max_output: int | None) -> int | None:
    """``max_output`` (bytes kept of each stream; ``None``: the agent's default), or
    ``InvalidArgument`` unless it is a whole number from 0 to :data:`MAX_OUTPUT`."""
    if max_output is None:
        return None
    if isinstance(max_output, bool) or not isinstance(max_output, int) or not 0 <= max_output <= MAX_OUTPUT:
        raise InvalidArgument(f"max_output {max_output!r} is out of range",
                              hint=f"give a whole number of bytes from 0 to {MAX_OUTPUT} ({MAX_OUTPUT >> 20} MiB); "
                                   "send larger output to a file and read it in parts")
    return max_output


def env_factor(name: str, default: int, doing: str) -> int:
    """A CPU-weight factor from the environment variable ``name`` (``default`` when unset or
    empty; 0 and 1 both mean none); ``InvalidArgument`` unless it is a whole number."""
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    if not text.isdigit():
        raise InvalidArgument(f"{name}={text!r} is not a whole number",
                              hint=f"set {name} to a factor such as {default}, or 0 to {doing} at the default weight")
    return max(int(text), 1)


_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(raw: int | str, what: str, hint: str, units: str = "KMGT") -> int:
    """``raw`` in bytes: a positive int, or a whole number with one of ``units`` as its
    suffix ("64M"); ``InvalidArgument`` (``what`` named, ``hint`` given) otherwise."""
    text = str(raw).strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] and text[-1:] in units else ""
    number = text[: len(text) - len(unit)]
    if isinstance(raw, bool) or not number.isdigit() or int(number) <= 0:
        raise InvalidArgument(f"{what} {raw!r} is not a size", hint=hint)
    return int(number) * _SUFFIXES[unit]
