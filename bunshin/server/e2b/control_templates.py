"""E2B's snapshots and templates on bunshin: a snapshot of a running sandbox is a template
(``Sandbox.create(snapshot_id)`` restores it); templates are listed and deleted; building
one (``POST /v3/templates`` and the rest) is refused by name: images come in with
``bunshin image`` and become templates on first use (:mod:`.templates`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response

from ...errors import NotFound
from ...workspace import Snapshot
from ..context import ServerContext
from . import control_out as out
from .sandboxes import Sandbox, Sandboxes, resources
from .shapes import ENVD_VERSION, MAX_PAGE, E2BError, SnapshotRequest, iso, rules
from .templates import BASE, TemplateRecord, Templates

BUILDS_REFUSED = ("building templates is not supported by bunshin's E2B API: load the image on the server "
                  "(`bunshin image pull|load`) and create sandboxes with its reference as the template "
                  "(made into a snapshot template on first use), or snapshot a sandbox (Sandbox.create_snapshot)")


def routes(r: APIRouter, ctx: ServerContext, sandboxes: Sandboxes, templates: Templates,
           running: Callable[[str], Sandbox]) -> None:
    """Add the snapshot and template routes to ``r``."""

    @r.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    def create_snapshot(sandbox_id: str, req: SnapshotRequest) -> dict[str, Any]:
        if req.memory is False:
            raise E2BError(400, "memory=false (a filesystem-only snapshot) is not supported: bunshin's snapshots "
                                "keep the memory; take it with the default mode")
        running(sandbox_id)
        snap = ctx.locked(sandbox_id, lambda ws: ws.snapshot())
        rec = templates.add_snapshot(snap, sandbox_id, req.name)
        return _snapshot_info(rec)

    @r.get("/snapshots")
    def list_snapshots(response: Response, sandbox_id: Annotated[str | None, Query(alias="sandboxID",
                                                                                 max_length=64)] = None,
                       name: Annotated[str | None, Query(max_length=256)] = None,
                       next_token: Annotated[str | None, Query(alias="nextToken", max_length=256)] = None,
                       limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE) -> list[dict[str, Any]]:
        wanted = name.removesuffix(":default") if name else None
        chosen = [t for t in templates.all() if t.kind == "snapshot"
                  and (sandbox_id is None or t.source == sandbox_id)
                  and (wanted is None or wanted == t.id or wanted in t.names)]
        items = sorted((((t.created_at, t.id), t) for t in chosen), key=lambda kv: kv[0], reverse=True)
        shown, token = out.page(items, next_token, limit, descending=True)
        if token:
            response.headers["X-Next-Token"] = token
        return [_snapshot_info(t) for t in shown]

    def _template(t: TemplateRecord) -> dict[str, Any]:
        """E2B's ``Template`` of a bunshin template (its build is the snapshot)."""
        try:
            memory = Snapshot.get(t.snapshot, config=ctx.config).record.memory_limit
        except NotFound:
            memory = None
        when = iso(t.created_at)
        return {"templateID": t.id, "buildID": t.snapshot, **resources(memory), "public": False,
                "aliases": list(t.names), "names": list(t.names) or [t.id], "createdAt": when, "updatedAt": when,
                "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0, "buildCount": 1,
                "envdVersion": ENVD_VERSION, "buildStatus": "ready"}

    @r.get("/templates")
    def list_templates() -> list[dict[str, Any]]:
        return [_template(t) for t in templates.all()]

    @r.get("/default-templates")
    def default_templates() -> list[dict[str, Any]]:
        rec = templates.find(BASE)
        return [_template(rec)] if rec is not None else []

    @r.delete("/templates/{template_id}", status_code=204)
    def delete_template(template_id: Annotated[str, "a template id or name"]) -> Response:
        rec = templates.find(template_id)
        if rec is None:
            raise NotFound(f"template {template_id[:256]!r} not found")
        templates.remove(rec)
        return Response(status_code=204)

    def refuse_build() -> None:
        raise E2BError(400, BUILDS_REFUSED)

    for path, method in (("/templates", "POST"), ("/v2/templates", "POST"), ("/v3/templates", "POST"),
                         ("/templates/{template_id}", "POST"), ("/templates/{template_id}", "PATCH"),
                         ("/v2/templates/{template_id}", "PATCH"),
                         ("/templates/{template_id}/builds/{build_id}", "POST"),
                         ("/v2/templates/{template_id}/builds/{build_id}", "POST")):
        r.add_api_route(path, refuse_build, methods=[method], status_code=202)

    @r.put("/sandboxes/{sandbox_id}/network", status_code=204)
    def update_network(sandbox_id: str, body: dict[str, Any]) -> Response:
        """A sandbox with internet access: its allow and deny rules replaced (omitted: none)."""
        running(sandbox_id)
        for name in body:
            if name not in ("allowOut", "denyOut") and body[name]:
                raise E2BError(400, f"network.{name}: not supported by bunshin's E2B API (allowOut and denyOut are)")
        allow, deny = rules(body.get("allowOut")), rules(body.get("denyOut"))
        ctx.locked(sandbox_id, lambda ws: ws.set_network_policy(allow, deny))  # none: StateConflict, 409
        return Response(status_code=204)


def _snapshot_info(t: TemplateRecord) -> dict[str, Any]:
    return {"snapshotID": t.id, "names": list(t.names)}
