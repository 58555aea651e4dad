"""The FastAPI application of ``bunshin serve``.

Every route but ``GET /v1/health`` needs ``Authorization: Bearer <token>``. Routes are
plain (blocking) functions: FastAPI runs them in its thread pool, sized at start
(``threads``; each sandbox's E2B calls take a bounded share of it, :mod:`.shares`).
Calls into one workspace that talk to its agent or dump it take that workspace's lock
(``bunshin.workspace.locks``, the same locks the groups' prefix caches take); ``DELETE`` does not wait for it. Errors answer with bunshin's
code, message, hint and details and its HTTP status; bad requests are
``invalid_argument`` with status 422 and the fields at fault.
"""

from __future__ import annotations

import hmac
import logging
import math
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio.to_thread
from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import MAX_BODY_SIZE_SCOPE_KEY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..api import models as m
from ..config import Config
from ..errors import BunshinError, InvalidArgument, PayloadTooLarge, Unauthorized
from ..runtime import snapshot as rsnap
from ..runtime.net.policy import NetworkMode
from ..runtime.state.store import Store
from . import (
    groups,
    images,
    rollouts,
    snapshots,
    streaming,
    swerex,
    tools,
    transfer,
    workspaces,
)
from . import network as network_routes
from .admission import Limits
from .context import CallerGone, ServerContext
from .e2b import control as e2b_control
from .e2b import hosts
from .e2b import portproxy as _portproxy  # noqa: F401  # registers get_host's proxy for the other ports
from .e2b.envd import app as _envd  # noqa: F401  # registers envd on port 49983 of every sandbox
from .e2b.interpreter import app as _interpreter  # noqa: F401  # registers the code interpreter on port 49999
from .e2b.sandbox_logs import timed_out
from .leases import SWEEP_EVERY_S
from .shares import SANDBOX_THREADS, THREADS

log = logging.getLogger("bunshin.server")
#: Largest request body a route parsing JSON takes (a JSON body is held several times over
#: while parsed; files travel as raw bodies, streamed within their own budgets).
MAX_JSON_BODY = 16 << 20


def _error(exc: BunshinError) -> JSONResponse:
    body = m.ErrorOut(code=exc.code, message=exc.message, hint=exc.hint, details=exc.details)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else {}
    if isinstance(exc.details.get("retry_after"), int | float):  # RateLimited, RequestInProgress
        headers["Retry-After"] = str(max(1, math.ceil(exc.details["retry_after"])))
    return JSONResponse(body.model_dump(), status_code=exc.http_status, headers=headers)


async def _sweep_leases(ctx: ServerContext) -> None:
    """Remove workspaces whose lease ran out, about once a second, for the server's life."""
    while True:
        try:
            ended = await anyio.to_thread.run_sync(ctx.leases.sweep)
            if ended:
                await anyio.to_thread.run_sync(timed_out, ctx, ended)
            await anyio.to_thread.run_sync(ctx.snapshot_leases.sweep)
        except Exception as e:  # a bad sweep must not end the sweeping
            log.warning("sweeping workspace leases failed: %s", e)
        await anyio.sleep(SWEEP_EVERY_S)


def create_app(config: Config, token: str, *, limits: Limits | None = None,
               default_ttl: float | None = None, e2b_domain: str | None = None,
               network: NetworkMode | str = NetworkMode.NONE,
               network_default: NetworkMode | str = NetworkMode.NONE, threads: int = THREADS,
               sandbox_threads: int = SANDBOX_THREADS) -> FastAPI:
    """The app serving ``config``'s workspaces to callers holding ``token``, within
    ``limits`` (admission control: caps and the create/fork rate; none by default);
    ``default_ttl``: the lease of workspaces made without one (none by default);
    ``e2b_domain``: the sandbox domain E2B's API answers (default ``localhost:<port>``);
    ``network``: the most network a workspace may get (``egress`` or ``none``), and
    ``network_default`` what one gets when its request does not say; ``threads``: the thread
    pool, of which one sandbox's E2B calls hold ``sandbox_threads`` at most and all of them half."""
    ctx = ServerContext(config, token, limits or Limits(), default_ttl=default_ttl, e2b_domain=e2b_domain,
                        network=NetworkMode.of(network), network_default=NetworkMode.of(network_default),
                        threads=threads, sandbox_threads=sandbox_threads)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.shares.start()  # the pool's size
        shutil.rmtree(config.paths.transfers, ignore_errors=True)  # a killed server's half-moved archives
        # One connection to the store held for the server's life: SQLite checkpoints the WAL
        # into the database (fsyncs) when its last connection closes, which every route's
        # Store.open/close would otherwise be (~30 ms a write on a busy disk against 0.5 ms)
        keeper = Store.open(config.db_path)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_sweep_leases, ctx)
                yield
                tg.cancel_scope.cancel()
        finally:
            rsnap.ahead.release()  # the templates' clones made ahead
            keeper.close()

    app = FastAPI(title="bunshin", version=__version__, lifespan=lifespan)
    app.add_middleware(_JsonTooLarge)
    app.add_middleware(hosts.SandboxRouter, ctx=ctx)  # E2B: requests naming a sandbox (header or host name)

    @app.exception_handler(BunshinError)
    async def _bunshin_error(_: Request, exc: BunshinError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413:  # a body over max_body_size, sent without a Content-Length
            return _too_large(request.scope)
        return await http_exception_handler(request, exc)

    @app.exception_handler(CallerGone)
    async def _caller_gone(_: Request, exc: CallerGone) -> Response:
        log.info("%s", exc)
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        err = InvalidArgument("invalid request: " + "; ".join(problems), hint="see /docs for the request shapes")
        return JSONResponse(m.ErrorOut(code=err.code, message=err.message, hint=err.hint).model_dump(),
                            status_code=422)

    def authorized(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("missing or wrong API token",
                               hint="send 'Authorization: Bearer <token>' (the token is in the server's "
                                    "token file, e.g. BUNSHIN_HOME/server.token)")

    @app.get("/v1/health")
    def health() -> m.Health:
        return m.Health(ok=True, version=__version__)

    # JSON bodies are parsed whole (held several times over): bounded per route (inside the
    # error handling); routes taking raw bodies set their own and stream them within budgets
    auth, most = [Depends(authorized)], MAX_JSON_BODY
    for r in (workspaces, snapshots, transfer, images, groups, rollouts, tools, streaming, network_routes):
        app.include_router(r.router(ctx), dependencies=auth, max_body_size=most)
    app.include_router(swerex.router(ctx), max_body_size=most)  # SWE-ReX's runtime API: its own X-API-Key check
    app.include_router(e2b_control.router(ctx), max_body_size=most)  # E2B's control plane: its own X-API-Key check
    return app


def _too_large(scope: Scope) -> JSONResponse:
    cap = scope.get(MAX_BODY_SIZE_SCOPE_KEY)
    limit = f"the {cap} bytes" if isinstance(cap, int) else "what"
    return _error(PayloadTooLarge(f"request body over {limit} this route takes",
                                  hint="send files as raw bodies (PUT /v1/workspaces/{id}/files/content) and "
                                       "large output to a file; JSON requests take at most "
                                       f"{MAX_JSON_BODY >> 20} MiB"))


class _JsonTooLarge:
    """Starlette's body limit (``max_body_size``) answers a declared ``Content-Length`` over it
    with a plain-text 413; bunshin answers every error as JSON (``ErrorOut``)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replaced = False

        async def send_json(message: Message) -> None:
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 413 and \
                    dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/plain"):
                replaced = True
                await _too_large(scope)(scope, receive, send)
            elif not replaced:
                await send(message)

        await self.app(scope, receive, send_json)
