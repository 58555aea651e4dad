"""Tools: specs, the built-ins, user tools, canonical call keys, running a call.

``ToolSet.default()`` holds ``bash`` (the workspace's persistent session),
``read_file``, ``write_file``, ``edit`` and ``python`` (a persistent
interpreter inside the workspace); ``command_tool``/``function_tool`` make user
tools. Invalid calls come back as an ``Observation`` with ``error`` set.
"""

from .custom import command_tool, function_tool
from .spec import (
    Observation,
    Step,
    Tool,
    ToolCall,
    ToolContext,
    ToolError,
    ToolOutput,
    ToolSpec,
    call_key,
)
from .toolset import ToolSet

__all__ = [
    "Observation",
    "Step",
    "Tool",
    "ToolCall",
    "ToolContext",
    "ToolError",
    "ToolOutput",
    "ToolSet",
    "ToolSpec",
    "call_key",
    "command_tool",
    "function_tool",
]
