"""User tools: a command template, or a Python function run inside the workspace."""

from __future__ import annotations

import inspect
import json
import shlex
import string
import textwrap
import typing
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import BunshinError, InvalidArgument
from ..runtime.agent_host.bundle import AgentBundle
from ..workspace.protocol import WorkspaceAPI
from .builtin import session_id, translate
from .spec import Tool, ToolContext, ToolError, ToolOutput, ToolSpec


def _quote(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return " ".join(_quote(v) for v in value)
    if isinstance(value, Mapping):
        return shlex.quote(json.dumps(value, sort_keys=True))
    return shlex.quote(str(value))


def command_tool(
    name: str,
    template: str,
    *,
    description: str = "",
    parameters: Mapping[str, Any] | None = None,
    deterministic: bool = True,
    read_only: bool = False,
    timeout: float = 120.0,
    session: bool = False,
) -> Tool:
    """A tool that runs ``template`` with its ``{placeholders}`` filled by shell-quoted arguments.

    ``session``: run in the persistent bash session (cwd and variables apply)
    rather than as a one-shot command in the working directory. Without
    ``parameters`` every placeholder is a required string.
    """
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
    if any(not f.isidentifier() for f in fields):
        raise InvalidArgument(f"template {template!r}: placeholders must be plain names like {{path}}")
    if parameters is None:
        parameters = {
            "type": "object",
            "properties": {f: {"type": "string"} for f in fields},
            "required": sorted(set(fields)),
            "additionalProperties": False,
        }

    def execute(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        cmd = template.format(**{f: _quote(args.get(f, "")) for f in fields})
        try:
            if session:
                r = ws.sessions.run(session_id(ws, ctx.workdir), cmd, timeout=ctx.timeout)
                return ToolOutput(r.output, r.exit_code, r.timed_out)
            e = ws.exec(cmd, timeout=ctx.timeout, cwd=ctx.workdir)
        except BunshinError as exc:
            raise translate(exc) from None
        return ToolOutput(e.stdout + e.stderr, None if e.timed_out else e.exit_code, e.timed_out)

    spec = ToolSpec(name, description or f"Run: {template}", parameters, deterministic, read_only, timeout)
    return Tool(spec, execute)


#: ``bunshin/agent/fndriver.py`` as the agent layer ships it: runs one function call.
DRIVER = f"{AgentBundle.PACKAGE_DIR}/fndriver.py"

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object", tuple: "array"}


def _schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    props: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = typing.get_origin(hints.get(p.name)) or hints.get(p.name)
        props[p.name] = {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}
        if p.default is p.empty:
            required.append(p.name)
        elif isinstance(p.default, str | int | float | bool) or p.default is None:
            props[p.name]["default"] = p.default
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def function_tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    deterministic: bool = True,
    read_only: bool = False,
    timeout: float = 120.0,
) -> Tool:
    """A tool that runs ``fn`` (a self-contained, module-level function) inside the workspace.

    Its source is sent to a fresh ``python3`` there and called with the
    arguments as keywords; a returned string is the output, anything else is
    shown as JSON. Imports must be inside the function. The schema comes from
    the signature's annotations unless ``parameters`` is given.
    """
    fname = fn.__name__
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    while lines and lines[0].startswith("@"):
        lines.pop(0)
    source = "\n".join(lines) + "\n"
    params = parameters if parameters is not None else _schema_of(fn)
    doc = description or (inspect.getdoc(fn) or f"Run {fname}").strip()

    def execute(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        req = json.dumps({"source": source, "name": fname, "args": dict(args)})
        try:
            r = ws.exec(["python3", DRIVER], stdin=req, timeout=ctx.timeout, cwd=ctx.workdir)
        except BunshinError as exc:
            raise translate(exc) from None
        if r.exit_code == 127:
            raise ToolError("python3 is not installed in this workspace")
        return ToolOutput(r.stdout + r.stderr, None if r.timed_out else r.exit_code, r.timed_out)

    spec = ToolSpec(name or fname, doc, params, deterministic, read_only, timeout)
    return Tool(spec, execute)
