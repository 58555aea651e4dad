"""The built-in tools: ``bash`` (the persistent session), ``read_file``,
``write_file``, ``edit`` (exact string replace). ``python`` lives in ``python_tool``.

Relative paths are resolved against the tool set's working directory.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from ..errors import (
    BunshinError,
    InvalidArgument,
    NotFound,
    PathNotFound,
    SnapshotNotFound,
    ToolTimeout,
    WorkspaceNotFound,
)
from ..runtime.kernel.limits import MAX_FILE_BYTES, MAX_TEXT_FILE_BYTES
from ..workspace.protocol import WorkspaceAPI
from .spec import Tool, ToolContext, ToolError, ToolOutput, ToolSpec

#: Largest file ``read_file`` shows; the rest is cut with a note (and never read).
MAX_READ_BYTES = 256 * 1024
#: Bytes read per piece while ``read_file`` looks for a line range.
SCAN_CHUNK = 1 << 20


def resolve(path: str, ctx: ToolContext) -> str:
    if not path:
        raise ToolError("path is empty")
    return posixpath.normpath(posixpath.join(ctx.workdir, path))


def translate(exc: BunshinError) -> BaseException:
    """Bad input, missing paths and timeouts are the tool's error (an observation);
    anything else (the workspace is gone, the agent failed...) stays an exception."""
    if isinstance(exc, PathNotFound):
        return ToolError(exc.message if "no such" in exc.message.lower() else f"{exc.message}: no such file")
    if isinstance(exc, WorkspaceNotFound | SnapshotNotFound):
        return exc
    if isinstance(exc, InvalidArgument | NotFound | ToolTimeout):
        return ToolError(exc.message)
    return exc


# --- bash ------------------------------------------------------------------------


def session_id(ws: WorkspaceAPI, workdir: str) -> str:
    """The workspace's first live bash session, opened (in ``workdir``) if there is none."""
    sessions = ws.sessions
    for s in sessions.list():
        if s.alive and s.kind in ("bash", "sh"):
            return s.session_id
        if not s.alive:
            sessions.close(s.session_id)
    try:
        return sessions.open("bash", cwd=workdir)
    except PathNotFound:
        return sessions.open("bash")


def _bash(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    r = ws.sessions.run(session_id(ws, ctx.workdir), args["command"], timeout=ctx.timeout)
    out = r.output
    if not r.alive:
        out += "\n(the shell exited; the next command starts a new one)"
    return ToolOutput(out, r.exit_code, r.timed_out)


BASH = Tool(
    ToolSpec(
        name="bash",
        description="Run a command in a persistent bash shell (cwd, variables and background jobs carry over between calls).",
        parameters={
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command line", "minLength": 1}},
            "required": ["command"],
            "additionalProperties": False,
        },
        timeout=300.0,
    ),
    _bash,
)


# --- files -----------------------------------------------------------------------


def _read(ws: WorkspaceAPI, path: str, offset: int, length: int) -> bytes:
    try:
        return ws.files.read(path, offset=offset, length=length)
    except BunshinError as exc:
        raise translate(exc) from None


def _read_text(ws: WorkspaceAPI, path: str) -> str:
    """A file edited whole: refused past ``MAX_TEXT_FILE_BYTES`` (read no more than that)."""
    data = _read(ws, path, 0, MAX_TEXT_FILE_BYTES + 1)
    if len(data) > MAX_TEXT_FILE_BYTES:
        raise ToolError(f"{path} is larger than {MAX_TEXT_FILE_BYTES >> 20} MiB: too large to edit whole; "
                        "change it with bash (sed, patch)")
    return data.decode("utf-8", errors="replace")


def _lines(ws: WorkspaceAPI, path: str, lo: int, hi: int | None) -> tuple[bytes, int]:
    """Lines ``lo`` to ``hi`` (0-based, ``hi`` exclusive; None: to the end) of the file, at most
    ``MAX_READ_BYTES + 1`` bytes of them kept, read a piece at a time and no further than
    needed; and how many lines it has (as far as it was read). A file of no line ends costs
    one piece of memory, not its size."""
    kept, seen, offset, partial = bytearray(), 0, 0, False
    while (hi is None or seen < hi) and len(kept) <= MAX_READ_BYTES:
        if offset >= MAX_FILE_BYTES:
            raise ToolError(f"{path}: line {lo + 1} is not in its first {MAX_FILE_BYTES >> 20} MiB",
                            hint="look for it with grep -n, then read around it")
        piece = _read(ws, path, offset, SCAN_CHUNK)
        if not piece:
            break
        offset += len(piece)
        ends = piece.count(b"\n")
        if seen + ends < lo:  # all before the range: count the lines only
            seen, partial = seen + ends, not piece.endswith(b"\n")
            continue
        at = 0
        while at < len(piece) and (hi is None or seen < hi):
            nl = piece.find(b"\n", at)
            stop = len(piece) if nl < 0 else nl + 1
            if seen >= lo and len(kept) <= MAX_READ_BYTES:
                kept += piece[at:stop][: MAX_READ_BYTES + 1 - len(kept)]
            partial, at = nl < 0, stop
            seen += nl >= 0
    return bytes(kept), seen + partial


def _read_file(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    path = resolve(args["path"], ctx)
    start, end = args.get("start_line"), args.get("end_line")
    if start is None and end is None:
        raw = _read(ws, path, 0, MAX_READ_BYTES + 1)  # no more than is shown
    else:
        lo = max(int(start or 1), 1) - 1
        raw, seen = _lines(ws, path, lo, None if end is None else int(end))
        if lo >= max(seen, 1) and seen:
            raise ToolError(f"{path} has {seen} lines; start_line {start} is past the end")
    if len(raw) > MAX_READ_BYTES:
        cut = raw[:MAX_READ_BYTES].decode("utf-8", errors="ignore")
        return ToolOutput(cut + f"\n[... cut at {MAX_READ_BYTES >> 10} KiB; read a line range]")
    return ToolOutput(raw.decode("utf-8", errors="replace"))


READ_FILE = Tool(
    ToolSpec(
        name="read_file",
        description="Show a text file (optionally a 1-based, inclusive line range).",
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1},
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
        read_only=True,
        timeout=30.0,
    ),
    _read_file,
)


def _write(ws: WorkspaceAPI, path: str, text: str) -> int:
    try:
        return int(ws.files.write(path, text.encode()))
    except BunshinError as exc:
        raise translate(exc) from None


def _write_file(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    path = resolve(args["path"], ctx)
    size = _write(ws, path, args["content"])
    return ToolOutput(f"wrote {size} bytes to {path}")


WRITE_FILE = Tool(
    ToolSpec(
        name="write_file",
        description="Create or overwrite a file with the given content (parent folders are created).",
        parameters={
            "type": "object",
            "properties": {"path": {"type": "string", "minLength": 1}, "content": {"type": "string"}},
            "required": ["path", "content"],
            "additionalProperties": False,
        },
        timeout=30.0,
    ),
    _write_file,
)


def _edit(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    path = resolve(args["path"], ctx)
    old, new = args["old_str"], args["new_str"]
    text = _read_text(ws, path)
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_str not found in {path}")
    if count > 1 and not args.get("replace_all"):
        raise ToolError(f"old_str occurs {count} times in {path}; add context to make it unique or set replace_all")
    _write(ws, path, text.replace(old, new))
    return ToolOutput(f"edited {path}: {count if args.get('replace_all') else 1} replacement(s)")


EDIT = Tool(
    ToolSpec(
        name="edit",
        description="Replace an exact string in a file. old_str must occur exactly once unless replace_all is true.",
        parameters={
            "type": "object",
            "properties": {
                "path": {"type": "string", "minLength": 1},
                "old_str": {"type": "string", "minLength": 1},
                "new_str": {"type": "string"},
                "replace_all": {"type": "boolean", "default": False},
            },
            "required": ["path", "old_str", "new_str"],
            "additionalProperties": False,
        },
        timeout=30.0,
    ),
    _edit,
)
