"""The FastAPI application of ``bunshin serve``.

Every route but ``GET /v1/health`` needs ``Authorization: Bearer <token>``. Routes are
plain (blocking) functions: FastAPI runs them in its thread pool, widened at start.
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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..api import models as m
from ..config import Config
from ..errors import BunshinError, InvalidArgument, Unauthorized
from . import groups, images, rollouts, snapshots, streaming, swerex, tools, transfer, workspaces
from .admission import Limits
from .context import CallerGone, ServerContext
from .leases import SWEEP_EVERY_S

log = logging.getLogger("bunshin.server")
#: Threads for blocking routes: each command, fork or session run in flight holds one.
THREADS = 256


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
            await anyio.to_thread.run_sync(ctx.leases.sweep)
            await anyio.to_thread.run_sync(ctx.snapshot_leases.sweep)
        except Exception as e:  # a bad sweep must not end the sweeping
            log.warning("sweeping workspace leases failed: %s", e)
        await anyio.sleep(SWEEP_EVERY_S)


def create_app(config: Config, token: str, *, limits: Limits | None = None,
               default_ttl: float | None = None) -> FastAPI:
    """The app serving ``config``'s workspaces to callers holding ``token``, within
    ``limits`` (admission control: caps and the create/fork rate; none by default);
    ``default_ttl``: the lease of workspaces made without one (none by default)."""
    ctx = ServerContext(config, token, limits or Limits(), default_ttl=default_ttl)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        shutil.rmtree(config.paths.transfers, ignore_errors=True)  # a killed server's half-moved archives
        async with anyio.create_task_group() as tg:
            tg.start_soon(_sweep_leases, ctx)
            yield
            tg.cancel_scope.cancel()

    app = FastAPI(title="bunshin", version=__version__, lifespan=lifespan)

    @app.exception_handler(BunshinError)
    async def _bunshin_error(_: Request, exc: BunshinError) -> JSONResponse:
        return _error(exc)

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

    auth = [Depends(authorized)]
    app.include_router(workspaces.router(ctx), dependencies=auth)
    app.include_router(snapshots.router(ctx), dependencies=auth)
    app.include_router(transfer.router(ctx), dependencies=auth)
    app.include_router(images.router(ctx), dependencies=auth)
    app.include_router(groups.router(ctx), dependencies=auth)
    app.include_router(rollouts.router(ctx), dependencies=auth)
    app.include_router(tools.router(ctx), dependencies=auth)
    app.include_router(streaming.router(ctx), dependencies=auth)
    app.include_router(swerex.router(ctx))  # SWE-ReX's runtime API: its own X-API-Key check
    return app
