"""Tool calls over HTTP: ``POST /v1/workspaces/{id}/tools/{name}`` runs one call of the
built-in tool set in a workspace (no cache: groups' trajectories have it), the desktop tools
included (``ToolSet.desktop``: in a workspace without a desktop they answer a tool error that
says how to get one); ``GET /v1/tools`` lists the tools in the OpenAI function-calling form
(``?desktop=true``: with the desktop tools)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from pydantic import Field

from ..api import groups as g
from ..api.models import Model
from ..tools import ToolSet
from .context import ServerContext


class ToolCallRequest(Model):
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    workdir: str = Field(default="/", min_length=1, description="where relative paths and new shells start")


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.get("/tools")
    def tools(desktop: bool = False) -> list[dict[str, Any]]:
        return (ToolSet.desktop() if desktop else ToolSet.default()).openai_tools()

    @api.post("/workspaces/{ws_id}/tools/{name}")
    def call_tool(ws_id: str, name: str, req: ToolCallRequest) -> g.ObservationOut:
        tools = ToolSet.desktop(workdir=req.workdir)
        obs = ctx.locked(ws_id, lambda ws: tools.run_sync(ws, name, req.arguments))
        return g.ObservationOut(**asdict(obs))

    return api
