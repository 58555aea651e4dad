"""The ASGI app of envd's port (49983) of every sandbox: the access token checked (or, for
``/files``, a URL the SDK signed: ``auth.file_url_refusal``), the sandbox found, then the
Connect services or the HTTP routes."""

from __future__ import annotations

import json
import threading
from urllib.parse import parse_qsl

import anyio.to_thread
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ....errors import NotFound, RateLimited, StateConflict
from ....workspace import Workspace
from ...context import ServerContext
from .. import hosts
from ..auth import file_url_refusal
from . import files, filesystem, process
from .rpc import CALL, Call, user_of

#: Connect services by the first segment of their paths.
SERVICES = ("/process.Process/", "/filesystem.Filesystem/")
#: Workspaces remembered between calls (looking one up reads the store).
KNOWN = 4096


class EnvdApp:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.rpc: dict[str, ASGIApp] = {SERVICES[0]: process.app(), SERVICES[1]: filesystem.app()}
        self._known: dict[str, Workspace] = {}  # by sandbox id, the oldest first
        self._lock = threading.Lock()

    def _workspace(self, sandbox_id: str) -> Workspace:
        """The running workspace of ``sandbox_id``: the one looked up before while its pid 1
        lives (a pause, resume or restart under the same id makes a new one), else from
        the store."""
        with self._lock:
            ws = self._known.get(sandbox_id)
        if ws is not None and ws.is_alive():
            return ws
        ws = self.ctx.ws_of(sandbox_id)
        if not ws.is_alive():
            raise StateConflict(f"sandbox {sandbox_id} is not running")
        with self._lock:
            self._known.pop(sandbox_id, None)
            if len(self._known) >= KNOWN:
                self._known.pop(next(iter(self._known)))
            self._known[sandbox_id] = ws
        return ws

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await hosts.refuse(scope, send, 400, "envd takes no websockets")
            return
        path: str = scope["path"]
        service = next((s for s in SERVICES if path.startswith(s)), None)
        t = hosts.target(scope)
        health = path == "/health"  # envd's own answers without a token; a sandbox not there is a 502
        if not health and not hosts.token_ok(self.ctx.token, scope):
            signed = _signed_query(scope) if path == "/files" else None  # download_url / upload_url
            why = (file_url_refusal(self.ctx.token, t.sandbox_id, scope["method"], signed) if signed else
                   f"missing or wrong access token for sandbox {t.sandbox_id}: send its envdAccessToken as X-Access-Token")
            if why is not None:
                await _refuse(scope, send, 401, why, service is not None, "unauthenticated")
                return
        try:  # a health check holds no token: it takes no thread of the sandbox's share
            ws = await (anyio.to_thread.run_sync(self._workspace, t.sandbox_id) if health
                        else self.ctx.shares.run(t.sandbox_id, self._workspace, t.sandbox_id))
        except RateLimited as e:
            await _refuse(scope, send, 429, e.message, service is not None, "resource_exhausted")
            return
        except (NotFound, StateConflict):
            await hosts.refuse(scope, send, 502, f"The sandbox {t.sandbox_id} was not found")
            return
        if health:
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        request = Request(scope, receive)
        try:
            user = user_of(request.headers.get("authorization"))
        except ConnectError as e:
            await _refuse(scope, send, 400, e.message, service is not None, "invalid_argument")
            return
        call = Call(self.ctx, ws, user)
        token = CALL.set(call)

        async def watched() -> Message:  # a stream's handler ends when its client hangs up
            message = await receive()
            if message["type"] == "http.disconnect":
                call.gone.set()
            return message

        try:
            if service is not None:
                await self.rpc[service](scope, watched, send)
            else:
                await (await files.answer(CALL.get(), request))(scope, receive, send)
        finally:
            CALL.reset(token)


def _signed_query(scope: Scope) -> dict[str, str] | None:
    """The query of a request carrying a file URL signature (each name's last value, as the routes
    read it), else None."""
    query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
    return query if "signature" in query else None


async def _refuse(scope: Scope, send: Send, status: int, message: str, rpc: bool, code: str) -> None:
    """An error before the call runs: Connect's shape for an RPC, envd's for its HTTP routes."""
    if not rpc:
        await hosts.refuse(scope, send, status, message)
        return
    body = json.dumps({"code": Code(code).value, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


hosts.register_port(hosts.ENVD_PORT, EnvdApp)
