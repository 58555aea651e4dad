"""The code interpreter's HTTP API (what ``e2b_code_interpreter.Sandbox`` calls on port
49999): ``POST /execute`` streaming JSON lines, ``/contexts`` create, list, restart, remove.

Which sandbox: the ``E2b-Sandbox-Id`` header the SDK sends, else the host name
``49999-<sandbox id>.<domain>``; the sandbox id is the workspace id. Every route needs the
sandbox's ``X-Access-Token`` (envd's, sent with ``/execute``) or its
``E2B-Traffic-Access-Token`` (the only one the SDK sends with the context routes).
Errors are plain text with bunshin's message and hint and its HTTP status: 404 is the SDK's
``NotFoundException``, any other its ``SandboxException("<status>: <text>")``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from ....errors import (
    BunshinError,
    InvalidArgument,
    NotFound,
    PathNotFound,
    RateLimited,
    Unauthorized,
    WorkspaceNotFound,
)
from ....workspace.locks import WorkspaceLocks, workspace_locks
from ....workspace.protocol import WorkspaceAPI
from ...context import ServerContext
from ...shares import Offload, Shares
from .. import hosts
from ..auth import envd_token_ok, traffic_token_ok
from ..sandboxes import sandbox_envs
from . import contexts
from .run import FIRST_POLL_S, POLL_S, CodeRun

#: The port E2B's SDK reaches the code interpreter on.
PORT = 49999
MAX_CODE_CHARS = 8 << 20
MAX_ENV_VARS = 1000
#: A request body (JSON: the code, up to 6 bytes a character when escaped, and its env vars).
MAX_BODY = 6 * MAX_CODE_CHARS + (8 << 20)
#: How long a run interrupted because its caller hung up is waited for (its files then go).
STOP_GRACE_S = 10.0
#: Runs streamed at once for one sandbox: each polls from a thread of its share of the pool.
MAX_RUNS = 32
_runs: dict[str, int] = {}  # sandbox id -> runs being streamed (the event loop's thread only)
_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_HOST = re.compile(rf"{PORT}-([A-Za-z0-9_-]{{1,128}})\.")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")

Resolver = Callable[[str], WorkspaceAPI]


class ExecuteIn(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS)
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


class ContextIn(BaseModel):
    language: str | None = None
    cwd: str | None = None


def sandbox_id_of(request: Request) -> str:
    """The sandbox a request is for: the one ``bunshin serve``'s router found
    (:mod:`..hosts`), else ``E2b-Sandbox-Id``, else the host name's."""
    routed = request.scope.get(hosts.SCOPE_KEY)
    given = routed.sandbox_id if isinstance(routed, hosts.Target) else request.headers.get("e2b-sandbox-id")
    if given is None:
        m = _HOST.match(request.headers.get("host", ""))
        given = m.group(1) if m else None
    if given is None or not _SANDBOX_ID.fullmatch(given):
        raise NotFound("no sandbox named in the request",
                       hint=f"send E2b-Sandbox-Id, or call {PORT}-<sandbox id>.<domain>")
    return given


def _env(env: dict[str, str] | None) -> dict[str, str]:
    env = env or {}
    if len(env) > MAX_ENV_VARS or any(not _ENV_NAME.fullmatch(k) or "\0" in v for k, v in env.items()):
        raise InvalidArgument(f"env_vars: at most {MAX_ENV_VARS} variables named like shell variables, "
                              "without NUL in their values", hint="e.g. envs={'MY_VAR': 'value'}")
    return env


def make_interpreter_app(resolve: Resolver, *, server_token: str, locks: WorkspaceLocks | None = None,
                         envs_of: Callable[[str], dict[str, str]] | None = None,
                         shares: Shares | None = None) -> FastAPI:
    """The interpreter's API over the workspaces ``resolve`` finds by sandbox id (raising
    :class:`~bunshin.errors.WorkspaceNotFound`), for callers holding a sandbox's token
    derived from ``server_token``; calls take ``locks`` (the process's by default) and
    threads of their sandbox's share of the pool (``shares``: the server's; its own by
    default); a run has ``envs_of(sandbox id)`` (the sandbox's ``envVars``), then its own
    ``env_vars``."""
    held = locks or workspace_locks()
    pool = shares or Shares()
    app = FastAPI(title="bunshin e2b code interpreter", openapi_url=None, docs_url=None, redoc_url=None,
                  max_body_size=MAX_BODY)

    @app.exception_handler(BunshinError)
    async def _error(_: Request, exc: BunshinError) -> Response:
        return PlainTextResponse(str(exc), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return PlainTextResponse(f"invalid request: {problems}", status_code=422)

    def authorized(request: Request) -> str:
        """The request's sandbox id, once its token is checked."""
        sid = sandbox_id_of(request)
        if not (envd_token_ok(server_token, sid, request.headers.get("x-access-token"))
                or traffic_token_ok(server_token, sid, request.headers.get("e2b-traffic-access-token"))):
            raise Unauthorized(f"missing or wrong access token for sandbox {sid}",
                               hint="send the sandbox's envdAccessToken (X-Access-Token) or trafficAccessToken "
                                    "(E2B-Traffic-Access-Token), both in its create and connect answers")
        return sid

    app.add_middleware(_TokenFirst, check=authorized)

    def sandbox(request: Request) -> WorkspaceAPI:
        sid = authorized(request)
        try:
            ws = resolve(sid)
            if ws.is_alive():
                return ws
        except WorkspaceNotFound:
            pass
        raise NotFound(f"sandbox {sid} not found", hint="it was killed, paused or timed out")

    async def locked(request: Request, fn: Callable[[WorkspaceAPI], Any]) -> Any:
        """``fn`` on the request's sandbox, under its lock, in a thread of its share."""
        def go() -> Any:
            ws = sandbox(request)
            with held.held(ws):
                return fn(ws)
        return await pool.run(authorized(request), go)

    @app.post("/contexts")
    async def create_context(request: Request, body: ContextIn) -> dict[str, str]:
        made = await locked(request, lambda ws: contexts.create(ws, body.language, body.cwd))
        return made.to_dict()

    @app.get("/contexts")
    async def list_contexts(request: Request) -> list[dict[str, str]]:
        found = await locked(request, contexts.listing)
        return [c.to_dict() for c in found]

    @app.post("/contexts/{context_id}/restart")
    async def restart_context(request: Request, context_id: str) -> Response:
        await locked(request, lambda ws: contexts.restart(ws, context_id))
        return Response(status_code=204)

    @app.delete("/contexts/{context_id}")
    async def remove_context(request: Request, context_id: str) -> Response:
        await locked(request, lambda ws: contexts.remove(ws, context_id))
        return Response(status_code=204)

    @app.post("/execute")
    async def execute(request: Request, body: ExecuteIn) -> Response:
        if body.context_id and body.language:
            raise InvalidArgument("give context_id or language, not both",
                                  hint="a context has its language already")
        env = _env(body.env_vars)
        context_id = contexts.check_id(body.context_id) if body.context_id else contexts.DEFAULT_ID
        contexts.language_of(body.language)
        sid = authorized(request)
        ws = await pool.run(sid, sandbox, request)
        if body.context_id:
            await pool.run(sid, _must_exist, ws, context_id)
        if envs_of is not None:
            env = {**await pool.run(sid, envs_of, ws.id), **env}
        if _runs.get(ws.id, 0) >= MAX_RUNS:
            raise RateLimited(f"the sandbox has {MAX_RUNS} runs streaming", hint="wait for one to end")
        run = CodeRun(ws, context_id, body.code, env, held.lock_of(ws))
        polls = functools.partial(pool.run, sid, refuse=False)  # a run let in is never refused midway
        return StreamingResponse(_counted(ws.id, _stream(run, polls)), media_type="application/x-ndjson")

    return app


class _TokenFirst:
    """The sandbox's token checked before a body is read (FastAPI reads a route's body
    before the route runs): a caller without it has nothing buffered for it."""

    def __init__(self, app: ASGIApp, check: Callable[[Request], str]) -> None:
        self.app = app
        self.check = check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                self.check(Request(scope))
            except BunshinError as e:
                await PlainTextResponse(str(e), status_code=e.http_status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _must_exist(ws: WorkspaceAPI, context_id: str) -> None:
    try:
        ws.files.read(f"{contexts.folder(context_id)}/context.json", length=4096)
    except PathNotFound:
        raise NotFound(f"context {context_id!r} not found", hint="list the contexts: GET /contexts") from None


async def _counted(sandbox_id: str, lines: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``lines``, counted in ``_runs`` while they stream (``MAX_RUNS`` checked again at the
    start: requests let in together count here)."""
    if _runs.get(sandbox_id, 0) >= MAX_RUNS:
        return
    _runs[sandbox_id] = _runs.get(sandbox_id, 0) + 1
    try:
        async for line in lines:
            yield line
    finally:
        _runs[sandbox_id] -= 1
        if not _runs[sandbox_id]:
            del _runs[sandbox_id]


async def _stream(run: CodeRun, polls: Offload) -> AsyncIterator[bytes]:
    """The run's lines as they come (each call in a thread of its sandbox's share, ``polls``);
    a caller that hangs up (the stream cancelled) interrupts it and, within
    :data:`STOP_GRACE_S`, waits for its answer so its files go too."""
    try:
        await polls(run.start)
        wait = FIRST_POLL_S
        while True:
            for piece in await polls(run.poll):
                yield piece
            if run.done:
                break
            await anyio.sleep(wait)
            wait = min(wait * 2, POLL_S)
        for piece in run.answer():
            yield piece
    finally:
        if not run.done:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_GRACE_S):
                await polls(run.interrupt)
                while not run.done:
                    await anyio.sleep(POLL_S)
                    await polls(run.poll)


def _served(ctx: ServerContext) -> FastAPI:
    """The interpreter of ``bunshin serve``: its workspaces, token and locks."""
    return make_interpreter_app(ctx.ws_of, server_token=ctx.token, locks=ctx.locks,
                                envs_of=lambda sid: sandbox_envs(ctx.config, sid), shares=ctx.shares)


hosts.register_port(PORT, _served)
