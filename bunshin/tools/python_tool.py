"""The ``python`` tool: a persistent interpreter living inside the workspace.

The interpreter is ``bunshin/agent/pyrepl.py``, which the agent layer ships into
every workspace: it runs there under the image's ``python3`` as an ordinary
process listening on a unix socket in ``/run/bunshin-tools``; each call is one
short ``python3 pyrepl.py call`` exec that starts it if needed, sends the code,
and prints the answer as JSON. Because the interpreter is a process of the
workspace, its globals are forked and snapshotted with everything else, and no
connection is open between calls. Like the interactive prompt, the value of a
trailing expression is printed. A call past its timeout gets SIGINT
(``KeyboardInterrupt``); an interpreter that ignores it is killed and the next
call starts a fresh one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import BunshinError
from ..runtime.agent_host.bundle import AgentBundle
from ..workspace.protocol import WorkspaceAPI
from .builtin import translate
from .spec import Tool, ToolContext, ToolError, ToolOutput, ToolSpec

TOOL_DIR = "/run/bunshin-tools"
#: ``bunshin/agent/pyrepl.py`` as the agent layer ships it into every workspace.
REPL = f"{AgentBundle.PACKAGE_DIR}/pyrepl.py"


def _python(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    req = json.dumps({"code": args["code"], "timeout": ctx.timeout})
    try:
        r = ws.exec(["python3", REPL, "call", TOOL_DIR, ctx.workdir], stdin=req, timeout=ctx.timeout + 15)
    except BunshinError as exc:
        raise translate(exc) from None
    if r.exit_code == 127:
        raise ToolError("python3 is not installed in this workspace")
    if r.exit_code != 0 or r.timed_out:
        raise ToolError(f"the python interpreter failed: {(r.stderr or r.stdout).strip()[-2000:]}")
    reply = json.loads(r.stdout)
    return ToolOutput(reply["output"], reply["exit_code"], bool(reply["timed_out"]))


PYTHON = Tool(
    ToolSpec(
        name="python",
        description="Run Python code in a persistent interpreter (variables and imports carry over); "
        "the value of a trailing expression is printed.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 1}},
            "required": ["code"],
            "additionalProperties": False,
        },
        timeout=300.0,
    ),
    _python,
)
