"""E2B's control plane on ``bunshin serve``: sandboxes made, listed, killed, timed, paused,
resumed and forked by the unmodified ``e2b`` SDK (``E2B_API_URL`` = this server,
``E2B_API_KEY`` = its token, sent as ``X-API-Key``).

A sandbox is a workspace (its id verbatim); its ``timeout`` is the workspace's lease; a
template is a snapshot, so a create is a restore (:mod:`.templates`); pause takes a
snapshot and removes the workspace, connect or resume restores it under the same id; fork
is bunshin's live fork (the source keeps running and its id). Errors answer in E2B's
shape (:class:`.shapes.E2BError`); a caller that hangs up before its answer leaves
nothing made behind (``ServerContext.made``).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import BunshinError, NotFound
from ...runtime.net.policy import NetworkMode
from ...workspace import Snapshot, Workspace
from ..context import CallerGone, ServerContext
from ..idempotency import IdemKey
from . import control_logs, control_templates
from . import control_out as out
from .sandbox_logs import logs_of
from .sandboxes import DEFAULT_TIMEOUT_S, Sandbox, Sandboxes, SandboxRecord, metadata_matches
from .shapes import (
    ENVD_VERSION,
    MAX_PAGE,
    ConnectSandbox,
    E2BError,
    ForkRequest,
    NewSandbox,
    PauseRequest,
    RefreshRequest,
    ResumedSandbox,
    TimeoutRequest,
    egress,
    refused,
)
from .templates import Templates

__all__ = ["ENVD_VERSION", "router"]
log = logging.getLogger("bunshin.server")

#: A create by the v1 route without a timeout lives this long (E2B's spec); v2's is 300 s.
V1_DEFAULT_TIMEOUT_S = 15
SandboxID = Annotated[str, "the sandbox id: a workspace id"]


class E2BRoute(APIRoute):
    """A route answering every error in E2B's shape, bad requests as 400."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except E2BError as e:
                return e.response()
            except BunshinError as e:
                return E2BError.of(e).response()
            except RequestValidationError as e:
                problems = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
                return E2BError(400, "invalid request: " + "; ".join(problems)).response()
            except (CallerGone, StarletteHTTPException):  # the app's: 499, and a body over its limit
                raise
            except Exception as e:  # a failure bunshin did not name: still E2B's shape (500)
                log.exception("%s %s failed", request.method, request.url.path)
                return E2BError(500, f"internal error: {type(e).__name__}: {e}").response()

        return route


def _authorized(token: str) -> Callable[..., None]:
    def check(x_api_key: Annotated[str | None, Header()] = None,
              authorization: Annotated[str | None, Header()] = None) -> None:
        given = x_api_key or ""
        if not given and authorization and authorization.lower().startswith("bearer "):
            given = authorization[7:].strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise E2BError(401, "missing or wrong API key: set E2B_API_KEY (or api_key=) to the bunshin server's "
                                "token (BUNSHIN_HOME/server.token on the server)")
    return check


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(route_class=E2BRoute, dependencies=[Depends(_authorized(ctx.token))], tags=["e2b"])
    sandboxes, templates, metrics = Sandboxes(ctx.config), Templates(ctx.config), out.Metrics()
    once = ctx.idempotency.run
    logs = logs_of(ctx)

    def _remove_snapshot(snap_id: str) -> None:
        try:
            Snapshot.get(snap_id, config=ctx.config).remove()
        except NotFound:
            pass

    def running(sandbox_id: str) -> Sandbox:
        sb = sandboxes.get(sandbox_id)
        if sb.info is None:
            raise E2BError(409, f"sandbox {sandbox_id} is paused: connect to it (Sandbox.connect) to resume it")
        return sb

    # --- create -------------------------------------------------------------------------

    def create(req: NewSandbox, key: str | None, request: Request, default_timeout: int) -> Response:
        if (why := refused(req)) is not None:
            raise E2BError(400, why)

        rules = egress(req)
        if rules is not None and ctx.network != NetworkMode.EGRESS:  # the server's ceiling holds here too
            raise E2BError(400, "allow_internet_access (or network rules): this server gives sandboxes no internet; "
                                "leave it out, or start the server with `bunshin serve --network egress`")

        def go() -> dict[str, Any]:
            snap, template_id = templates.snapshot_of(req.template_id, egress=rules is not None)
            with ctx.admission.admit(1, snap.record.memory_limit, snap.record.pids_limit):
                made = snap.restore(1, ahead=rules is None)  # the template's next clone made ahead
            try:
                if rules is not None and (rules[0] or rules[1]):
                    made[0].set_network_policy(*rules)
                elif req.allow_internet_access is False and snap.record.network == "egress":
                    made[0].set_network_policy(deny=["0.0.0.0/0"])  # E2B: false is denyOut 0.0.0.0/0
            except BaseException:  # a rule the policy refuses: nothing made
                made[0].remove()
                raise
            timeout = req.timeout or default_timeout
            ctx.keep(request, made, timeout)
            internet = snap.record.network == "egress" and req.allow_internet_access is not False
            rec = SandboxRecord(made[0].id, template_id, time.time(), timeout, req.metadata or {},
                                req.env_vars or {}, True if internet else req.allow_internet_access)
            sandboxes.put(rec)
            logs.info(rec.id, f"sandbox created from template {template_id} (timeout {timeout} s)", event="created",
                      templateID=template_id)
            return out.created(ctx, request, rec)
        return once(key, "POST", request.url.path, req, 201, go)

    @r.post("/v2/sandboxes", status_code=201)
    def create_v2(req: NewSandbox, key: IdemKey, request: Request) -> Response:
        return create(req, key, request, DEFAULT_TIMEOUT_S)

    @r.post("/sandboxes", status_code=201)
    def create_v1(req: NewSandbox, key: IdemKey, request: Request) -> Response:
        return create(req, key, request, V1_DEFAULT_TIMEOUT_S)

    # --- read ---------------------------------------------------------------------------

    @r.get("/sandboxes/metrics")
    def metrics_of(sandbox_ids: Annotated[str, Query(max_length=100 * 20)]) -> dict[str, Any]:
        ids = [i for i in sandbox_ids.split(",") if i]
        if not 1 <= len(ids) <= MAX_PAGE:
            raise E2BError(400, f"sandbox_ids: 1 to {MAX_PAGE} ids, comma-separated")
        found = {}
        for sid in dict.fromkeys(ids):
            try:
                if sandboxes.get(sid).info is not None:
                    found[sid] = metrics.sample(ctx, sid)
            except NotFound:
                continue
        return {"sandboxes": found}

    @r.get("/sandboxes/{sandbox_id}")
    def info(sandbox_id: SandboxID, request: Request) -> dict[str, Any]:
        return out.detail(ctx, request, sandboxes.get(sandbox_id))

    @r.get("/sandboxes/{sandbox_id}/metrics")
    def sandbox_metrics(sandbox_id: SandboxID, start: Annotated[int | None, Query(ge=0)] = None,
                        end: Annotated[int | None, Query(ge=0)] = None) -> list[dict[str, Any]]:
        """One sample, now (bunshin keeps no history): inside ``[start, end]`` or none."""
        sb = sandboxes.get(sandbox_id)
        now = time.time()
        if sb.info is None or (start is not None and start > now) or (end is not None and end < now - 1):
            return []
        return [metrics.sample(ctx, sandbox_id)]

    @r.get("/sandboxes")
    def list_v1(metadata: Annotated[str | None, Query(max_length=8192)] = None) -> list[dict[str, Any]]:
        wanted = _metadata_query(metadata)
        return [out.listed(ctx, sb) for sb in sandboxes.all()
                if sb.state == "running" and metadata_matches(sb.record, wanted)]

    @r.get("/v2/sandboxes")
    def list_v2(response: Response, metadata: Annotated[str | None, Query(max_length=8192)] = None,
                state: Annotated[str | None, Query(max_length=64)] = None,
                order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
                template: Annotated[str | None, Query(max_length=256)] = None,
                next_token: Annotated[str | None, Query(alias="nextToken", max_length=256)] = None,
                limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE) -> list[dict[str, Any]]:
        wanted = _metadata_query(metadata)
        states = set((state or "running,paused").split(","))
        if not states <= {"running", "paused"}:
            raise E2BError(400, f"state {state!r}: running, paused or both (comma-separated)")
        chosen = [sb for sb in sandboxes.all() if sb.state in states and metadata_matches(sb.record, wanted)
                  and (template is None or sb.record.template_id == template)]
        items = sorted((((sb.record.started_at, sb.id), sb) for sb in chosen), key=lambda kv: kv[0],
                       reverse=order == "desc")
        shown, token = out.page(items, next_token, limit, descending=order == "desc")
        if token:
            response.headers["X-Next-Token"] = token
        response.headers["X-Total-Running"] = str(sum(sb.state == "running" for sb in chosen))
        return [out.listed(ctx, sb) for sb in shown]

    # --- kill and timeouts --------------------------------------------------------------

    @r.delete("/sandboxes/{sandbox_id}", status_code=204)
    def kill(sandbox_id: SandboxID) -> Response:
        with sandboxes.held(sandbox_id):
            sb = sandboxes.get(sandbox_id)
            if sb.info is not None:
                ws = Workspace.get(sandbox_id, config=ctx.config)
                ws.remove()
                ctx.locks.drop(ws)
                ctx.leases.drop(sandbox_id)
            elif sb.record.snapshot:
                _remove_snapshot(sb.record.snapshot)
            sandboxes.drop(sandbox_id)
            metrics.forget(sandbox_id)
            logs.info(sandbox_id, "sandbox killed", event="killed")
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    def set_timeout(sandbox_id: SandboxID, req: TimeoutRequest) -> Response:
        with sandboxes.held(sandbox_id):
            sb = sandboxes.get(sandbox_id)
            if sb.info is not None:
                ctx.leases.grant([sandbox_id], req.timeout)
            sandboxes.put(_with(sb.record, timeout=req.timeout))
            logs.info(sandbox_id, f"timeout set to {req.timeout} s", event="timeout", timeout=req.timeout)
        return Response(status_code=204)

    @r.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
    def refresh(sandbox_id: SandboxID, req: RefreshRequest | None = None) -> Response:
        sb = running(sandbox_id)
        _extend(sandbox_id, (req.duration if req else None) or sb.record.timeout or DEFAULT_TIMEOUT_S)
        return Response(status_code=204)

    def _extend(sandbox_id: str, timeout: int) -> None:
        """The lease runs at least ``timeout`` more seconds (a longer one stays)."""
        lease = ctx.leases.get(sandbox_id)
        if lease is None or lease.expires_at < time.time() + timeout:
            ctx.leases.grant([sandbox_id], timeout)
            logs.info(sandbox_id, f"timeout extended to {timeout} s from now", event="timeout", timeout=timeout)

    # --- pause, connect, resume ---------------------------------------------------------

    @r.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    def pause(sandbox_id: SandboxID, req: PauseRequest | None = None) -> Response:
        if req is not None and req.memory is False:
            raise E2BError(400, "memory=false (a filesystem-only pause) is not supported: bunshin's pause keeps "
                                "the memory; pause with the default mode")
        with sandboxes.held(sandbox_id):
            sb = sandboxes.get(sandbox_id)
            if sb.info is None:
                raise E2BError(409, f"sandbox {sandbox_id} is already paused")
            lease = ctx.leases.get(sandbox_id)
            ws, snap = ctx.locked(sandbox_id, lambda w: (w, w.snapshot()))
            timeout = sb.record.timeout or (int(lease.ttl) if lease else None)
            sandboxes.paused(Sandbox(_with(sb.record, timeout=timeout), sb.info), snap.id)
            ws.remove()
            ctx.locks.drop(ws)
            ctx.leases.drop(sandbox_id)
            metrics.forget(sandbox_id)
            logs.info(sandbox_id, f"sandbox paused (snapshot {snap.id})", event="paused", snapshotID=snap.id)
        return Response(status_code=204)

    def resume(sandbox_id: str, timeout: int | None, request: Request) -> tuple[int, dict[str, Any]]:
        """Connect: a running sandbox's lease extended (200), a paused one restored under its
        id (201)."""
        with sandboxes.held(sandbox_id):
            sb = sandboxes.get(sandbox_id)
            if sb.info is not None:
                _extend(sandbox_id, timeout or sb.record.timeout or DEFAULT_TIMEOUT_S)
                return 200, out.created(ctx, request, sb.record)
            snap = Snapshot.get(sb.record.snapshot or "", config=ctx.config)
            with ctx.admission.admit(1, snap.record.memory_limit, snap.record.pids_limit):
                made = snap.restore(1, ids=[sandbox_id])
            ttl = timeout or sb.record.timeout or DEFAULT_TIMEOUT_S
            ctx.keep(request, made, ttl)  # a caller gone: removed again, still paused
            rec = sandboxes.resumed(sb.record, ttl)
            snap.remove()  # its files stay while the workspace stacks on them
            logs.info(sandbox_id, f"sandbox resumed (timeout {ttl} s)", event="resumed")
            return 201, out.created(ctx, request, rec)

    def _no_reboot(memory: bool | None) -> None:
        if memory is False:
            raise E2BError(400, "memory=false (on_resume='reboot', a cold boot from disk) is not supported: "
                                "bunshin resumes the memory it paused with")

    @r.post("/sandboxes/{sandbox_id}/connect")
    def connect_v1(sandbox_id: SandboxID, req: ConnectSandbox, request: Request) -> JSONResponse:
        _no_reboot(req.memory)
        status, body = resume(sandbox_id, req.timeout, request)
        return JSONResponse(body, status_code=status)

    @r.post("/v2/sandboxes/{sandbox_id}/connect")
    def connect_v2(sandbox_id: SandboxID, req: ConnectSandbox, request: Request) -> JSONResponse:
        return connect_v1(sandbox_id, req, request)

    @r.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    def resume_v1(sandbox_id: SandboxID, req: ResumedSandbox, request: Request) -> JSONResponse:
        _no_reboot(req.memory)
        if req.auto_pause:
            raise E2BError(400, "autoPause: not supported by bunshin's E2B API (leave it out)")
        if sandboxes.get(sandbox_id).info is not None:
            raise E2BError(409, f"sandbox {sandbox_id} is already running")
        status, body = resume(sandbox_id, req.timeout, request)
        return JSONResponse(body, status_code=status)

    # --- fork ---------------------------------------------------------------------------

    @r.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    def fork(sandbox_id: SandboxID, request: Request, key: IdemKey, req: ForkRequest | None = None) -> Response:
        req = req or ForkRequest()
        sb = running(sandbox_id)

        def go() -> list[dict[str, Any]]:
            info = sb.info
            assert info is not None
            lease = ctx.leases.get(sandbox_id)
            ttl = req.timeout or (int(lease.ttl) if lease else None) or sb.record.timeout or DEFAULT_TIMEOUT_S
            with ctx.admission.admit(req.count, info.memory_limit, info.pids_limit):
                try:
                    clones = ctx.locked(sandbox_id, lambda ws: ws.fork(req.count))
                except BunshinError as e:  # all or none: each fork failed alike
                    err = E2BError.of(e)
                    return [{"error": {"code": err.status, "message": err.message}}] * req.count
            ctx.keep(request, clones, ttl)
            now = time.time()
            recs = [_with(sb.record, id=c.id, started_at=now, timeout=ttl) for c in clones]
            sandboxes.put(*recs)
            for rec in recs:
                logs.info(rec.id, f"sandbox forked from {sandbox_id}", event="forked", sourceID=sandbox_id)
            logs.info(sandbox_id, f"sandbox forked into {len(recs)}: {', '.join(r.id for r in recs)}", event="fork",
                      count=len(recs))
            return [{"sandbox": out.created(ctx, request, rec)} for rec in recs]
        return once(key, "POST", request.url.path, req, 201, go)

    control_templates.routes(r, ctx, sandboxes, templates, running)
    control_logs.routes(r, ctx, sandboxes)
    return r


def _with(rec: SandboxRecord, **changes: Any) -> SandboxRecord:
    from dataclasses import replace

    return replace(rec, **changes)


def _metadata_query(text: str | None) -> dict[str, str]:
    """E2B's metadata filter: ``k=v&k2=v2``, each key and value URL-encoded once more."""
    if not text:
        return {}
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=True, max_num_fields=64)
    except ValueError:
        raise E2BError(400, f"metadata {text[:80]!r}: give key=value pairs joined by &, URL-encoded") from None
    return {unquote(k): unquote(v) for k, v in pairs}


