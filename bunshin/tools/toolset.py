"""``ToolSet``: the tools of a task, their schemas, and running a call in a workspace."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import BunshinError, InvalidArgument
from ..workspace.aio import AsyncWorkspace
from ..workspace.protocol import WorkspaceAPI
from . import schema
from .builtin import BASH, EDIT, READ_FILE, WRITE_FILE, translate
from .custom import command_tool, function_tool
from .desktop import DESKTOP_TOOLS
from .python_tool import PYTHON
from .spec import Observation, Tool, ToolContext, ToolError, ToolSpec, call_key


class ToolSet:
    """An ordered set of tools; relative paths and new shells start in ``workdir``."""

    def __init__(self, tools: Iterable[Tool] = (), *, workdir: str = "/") -> None:
        self.workdir = workdir
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    @classmethod
    def default(cls, *, workdir: str = "/") -> ToolSet:
        """The built-ins: ``bash``, ``read_file``, ``write_file``, ``edit``, ``python``."""
        return cls([BASH, READ_FILE, WRITE_FILE, EDIT, PYTHON], workdir=workdir)

    @classmethod
    def desktop(cls, *, workdir: str = "/") -> ToolSet:
        """The built-ins plus the desktop tools (``screenshot``, clicks, keys, ``launch``...:
        :mod:`bunshin.tools.desktop`), for a workspace made with a desktop."""
        return cls([BASH, READ_FILE, WRITE_FILE, EDIT, PYTHON, *DESKTOP_TOOLS], workdir=workdir)

    # --- the set --------------------------------------------------------------------

    def add(self, tool: Tool, *, replace: bool = False) -> ToolSet:
        if not isinstance(tool, Tool):
            raise InvalidArgument(f"not a Tool: {tool!r}", hint="use command_tool() or function_tool()")
        if not tool.name.replace("_", "").replace("-", "").isalnum():
            raise InvalidArgument(f"tool name {tool.name!r}: use letters, digits, '_' and '-'")
        if tool.name in self._tools and not replace:
            raise InvalidArgument(f"a tool named {tool.name!r} is already in the set", hint="pass replace=True")
        self._tools[tool.name] = tool
        return self

    def command(self, name: str, template: str, *, replace: bool = False, **kw: Any) -> ToolSet:
        """Add a command-template tool (see ``command_tool``)."""
        return self.add(command_tool(name, template, **kw), replace=replace)

    def function(self, fn: Callable[..., Any], *, replace: bool = False, **kw: Any) -> ToolSet:
        """Add a Python function run inside the workspace (see ``function_tool``)."""
        return self.add(function_tool(fn, **kw), replace=replace)

    def get(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(self._tools)}") from None

    def spec(self, name: str) -> ToolSpec:
        return self.get(name).spec

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def openai_tools(self) -> list[dict[str, Any]]:
        """The set in the OpenAI function-calling format (``tools=`` of a chat request)."""
        return [t.spec.openai() for t in self._tools.values()]

    # --- calls ----------------------------------------------------------------------

    def check(self, name: str, args: Mapping[str, Any] | str | None) -> tuple[Tool, dict[str, Any]]:
        """The tool and its arguments with defaults filled in; ``ToolError`` if invalid.

        ``args`` may be the JSON text a model produced.
        """
        tool = self.get(name)
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise ToolError(f"invalid arguments for {name!r}: not JSON ({exc})") from None
        if not isinstance(args, Mapping):
            raise ToolError(f"invalid arguments for {name!r}: expected an object, got {type(args).__name__}")
        problems = schema.errors(tool.spec.parameters, args)
        if problems:
            raise ToolError(f"invalid arguments for {name!r}: " + "; ".join(problems))
        return tool, schema.with_defaults(tool.spec.parameters, args)

    def key(self, name: str, args: Mapping[str, Any]) -> str:
        """The cache key of a (checked) call."""
        return call_key(name, args)

    def run_sync(self, ws: WorkspaceAPI, name: str, args: Mapping[str, Any] | str | None) -> Observation:
        """Run one call in ``ws`` (blocking). Bad calls and tool failures come back as
        an observation with ``error``; a broken workspace raises."""
        t0 = time.perf_counter()
        try:
            tool, checked = self.check(name, args)
            out = tool.execute(ws, checked, ToolContext(self.workdir, tool.spec.timeout))
        except ToolError as exc:
            return Observation("", None, exc.message, duration_s=time.perf_counter() - t0)
        except BunshinError as exc:
            err = translate(exc)
            if not isinstance(err, ToolError):
                raise
            return Observation("", None, err.message, duration_s=time.perf_counter() - t0)
        return Observation(out.output, out.exit_code, None, out.timed_out, time.perf_counter() - t0,
                           images=out.images)

    async def run(self, ws: AsyncWorkspace, name: str, args: Mapping[str, Any] | str | None) -> Observation:
        """Run one call in ``ws``, under its lock, in a bridge thread (tools block)."""
        return await ws.call(self.run_sync, ws.sync, name, args)
