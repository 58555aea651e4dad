"""Which sandbox and port an E2B request is for, and which app answers it.

The SDK reaches a sandbox two ways, both on the one ``bunshin serve`` port:

- ``sandbox_url`` mode (``E2B_SANDBOX_URL``): every envd call goes to the server's own URL
  with the headers ``E2b-Sandbox-Id: <sandbox id>`` and ``E2b-Sandbox-Port: 49983``;
- host-name mode: ``https://<port>-<sandbox id>.<domain>`` (what ``get_host(port)`` gives
  and, without ``sandbox_url``, where envd is), behind a wildcard DNS name and certificate
  for ``*.<domain>`` pointing at the server.

:class:`SandboxRouter` (ASGI middleware, outermost) reads the target from those headers or
from the first label of ``Host``, puts it in the scope (:func:`target`) and hands the
request to the app registered for the port (:func:`register_port`: envd on 49983, the code
interpreter on 49999, ...) or, for any other port, to :mod:`.portproxy`, which forwards it
to that port inside the sandbox. A request naming no sandbox goes on to bunshin's own
routes and E2B's control plane. An E2B sandbox id is the bunshin workspace id, verbatim;
names are not sandbox ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from ...runtime.container.lifecycle import ID_RE
from .auth import envd_token_ok, traffic_token_ok

if TYPE_CHECKING:
    from ..context import ServerContext

#: envd's port inside an E2B sandbox (``ConnectionConfig.envd_port``).
ENVD_PORT = 49983
#: Headers the SDK sends in ``sandbox_url`` mode.
SANDBOX_ID_HEADER = b"e2b-sandbox-id"
SANDBOX_PORT_HEADER = b"e2b-sandbox-port"
#: The headers of a sandbox's tokens: envd's, and the one E2B's proxy takes for the
#: sandbox's own ports (``trafficAccessToken``).
ENVD_TOKEN_HEADER = b"x-access-token"
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
#: A workspace id (``runtime.container.lifecycle.new_id``).
SANDBOX_ID = ID_RE
_HOST_LABEL = re.compile(rb"([0-9]{1,5})-(ws-[0-9a-f]{12})")
#: Where the router puts the :class:`Target` in an ASGI scope.
SCOPE_KEY = "bunshin.e2b.target"
MAX_PORT = 65535

#: Makes the ASGI app answering one port of every sandbox, given the server's context.
PortApp = Callable[["ServerContext"], ASGIApp]
_PORTS: dict[int, PortApp] = {}
_OTHER: list[PortApp] = []  # the app of every other port (``portproxy`` registers itself)


@dataclass(frozen=True)
class Target:
    """The sandbox and port a request is for; ``by_host``: named by the ``Host`` header."""

    sandbox_id: str
    port: int
    by_host: bool


def register_port(port: int, make: PortApp) -> None:
    """Let ``make(ctx)`` answer requests for ``port`` of any sandbox (once per server;
    registering the same maker again is a no-op, another one for a taken port an error)."""
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"port {port} is not a TCP port")
    if _PORTS.get(port, make) is not make:
        raise ValueError(f"port {port} already has an app registered")
    _PORTS[port] = make


def register_other_ports(make: PortApp) -> None:
    """Let ``make(ctx)`` answer every port no app is registered for (the proxy into the sandbox)."""
    if _OTHER and _OTHER[0] is not make:
        raise ValueError("the other ports already have an app registered")
    _OTHER[:] = [make]


def registered_ports() -> dict[int, PortApp]:
    return dict(_PORTS)


def target(scope: Scope) -> Target:
    """The target the router put in ``scope`` (apps registered for a port call this)."""
    t: Target = scope[SCOPE_KEY]
    return t


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or []:
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


def token_ok(server_token: str, scope: Scope) -> bool:
    """Whether the request carries its target sandbox's envd access token (``X-Access-Token``;
    another sandbox's opens nothing here)."""
    return envd_token_ok(server_token, target(scope).sandbox_id, _header(scope, ENVD_TOKEN_HEADER))


def traffic_ok(server_token: str, scope: Scope) -> bool:
    """Whether the request may reach its sandbox's ports: its traffic token
    (``E2B-Traffic-Access-Token``) or its envd access token (``X-Access-Token``)."""
    sid = target(scope).sandbox_id
    return traffic_token_ok(server_token, sid, _header(scope, TRAFFIC_TOKEN_HEADER)) or \
        envd_token_ok(server_token, sid, _header(scope, ENVD_TOKEN_HEADER))


def target_of(scope: Scope) -> Target | None:
    """The sandbox and port a request names, or ``None`` (then it is for bunshin's own routes).
    A header naming something that is not a sandbox id names a sandbox that is not there."""
    headers = dict(scope.get("headers") or [])
    sid = headers.get(SANDBOX_ID_HEADER)
    if sid is not None:
        port_text = headers.get(SANDBOX_PORT_HEADER, str(ENVD_PORT).encode())
        port = int(port_text) if port_text.isdigit() and len(port_text) <= 5 else 0
        return Target(sid.decode("latin-1")[:64], port, by_host=False)
    host = headers.get(b"host", b"").split(b":", 1)[0].lower()
    m = _HOST_LABEL.fullmatch(host.split(b".", 1)[0])
    if m is None:
        return None
    return Target(m.group(2).decode(), int(m.group(1)), by_host=True)


class SandboxRouter:
    """ASGI middleware: requests naming a sandbox go to the app of their port."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx
        self._apps: dict[int, ASGIApp] = {}
        self._proxy: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        t = target_of(scope)
        if t is None:
            await self.app(scope, receive, send)
            return
        if not 1 <= t.port <= MAX_PORT or SANDBOX_ID.fullmatch(t.sandbox_id) is None:
            await refuse(scope, send, 502 if 1 <= t.port <= MAX_PORT else 400,
                         f"The sandbox {t.sandbox_id!r} was not found" if 1 <= t.port <= MAX_PORT
                         else "E2b-Sandbox-Port is not a port (1..65535)")
            return
        scope = {**scope, SCOPE_KEY: t}
        await self._app_for(t.port)(scope, receive, send)

    def _app_for(self, port: int) -> ASGIApp:
        app = self._apps.get(port)
        if app is None:
            make = _PORTS.get(port)
            if make is None:
                if self._proxy is None:
                    self._proxy = _OTHER[0](self.ctx) if _OTHER else _no_app
                return self._proxy
            app = self._apps[port] = make(self.ctx)
        return app


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    await refuse(scope, send, 502, f"port {target(scope).port} of sandboxes is not served")


async def refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    """Answer ``status`` with E2B's error body (``{"code", "message"}``); a websocket too when
    the ASGI server can answer its handshake so (``websocket.http.response``), else it is
    closed (1008, which a client sees as 403)."""
    http = scope["type"] == "http"
    if not http and "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"code": status, "message": message}).encode()
    prefix = "http" if http else "websocket.http"
    await send({"type": f"{prefix}.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": f"{prefix}.response.body", "body": body})
