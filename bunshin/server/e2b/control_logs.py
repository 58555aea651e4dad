"""E2B's sandbox logs routes: ``GET /sandboxes/{id}/logs`` (v1: ``start``, ``limit``; the
entries as JSON lines and structured) and ``GET /v2/sandboxes/{id}/logs`` (``cursor``,
``limit``, ``direction``, ``level``, ``search``), from the server's record of each sandbox
(:mod:`.sandbox_logs`). A sandbox the server does not know and keeps no logs of is 404."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from ..context import ServerContext
from .sandbox_logs import MAX_ENTRIES, Entry, Level, logs_of, select
from .sandboxes import Sandboxes

#: E2B's ``limit`` of the v2 route: 0..1000 (default 1000); v1 takes any and gets at most this.
MAX_LIMIT = 1000
MAX_SEARCH = 256
INT64 = (1 << 63) - 1
Levels = "^(debug|info|warn|error)$"


def routes(r: APIRouter, ctx: ServerContext, sandboxes: Sandboxes) -> None:
    """Add the logs routes to ``r`` (whose dependencies check the API key)."""
    logs = logs_of(ctx)

    def kept(sandbox_id: str) -> list[Entry]:
        if not logs.has(sandbox_id):
            sandboxes.get(sandbox_id)  # NotFound (404) for a sandbox that is not there
        return logs.entries(sandbox_id)

    @r.get("/sandboxes/{sandbox_id}/logs")
    def logs_v1(sandbox_id: str, start: Annotated[int | None, Query(ge=0, le=INT64)] = None,
                limit: Annotated[int, Query(ge=0, le=(1 << 31) - 1)] = MAX_LIMIT) -> dict[str, Any]:
        chosen = select(kept(sandbox_id), cursor=start, limit=min(limit, MAX_ENTRIES), forward=True)
        return {"logs": [e.to_line() for e in chosen], "logEntries": [e.to_entry() for e in chosen]}

    @r.get("/v2/sandboxes/{sandbox_id}/logs")
    def logs_v2(sandbox_id: str, cursor: Annotated[int | None, Query(ge=0, le=INT64)] = None,
                limit: Annotated[int, Query(ge=0, le=MAX_LIMIT)] = MAX_LIMIT,
                direction: Annotated[str, Query(pattern="^(forward|backward)$")] = "forward",
                level: Annotated[str | None, Query(pattern=Levels)] = None,
                search: Annotated[str | None, Query(max_length=MAX_SEARCH)] = None) -> dict[str, Any]:
        chosen = select(kept(sandbox_id), cursor=cursor, limit=limit, forward=direction == "forward",
                        level=Level.of(level) if level else Level.DEBUG, search=search)
        return {"logs": [e.to_entry() for e in chosen]}

