"""``get_host(port)``: HTTP to a port inside a sandbox, forwarded by the server.

A request for ``<port>-<sandbox id>.<domain>`` (or ``E2b-Sandbox-Port: <port>``) with a port
no app is registered for is sent on, HTTP/1.1 over a TCP connection the host makes into the
workspace's own network namespace (``Workspace.connect_port``), one connection per request
(``Connection: close``), framed both ways by ``h11``; bodies stream through in pieces.
The request must carry the sandbox's traffic token (``E2B-Traffic-Access-Token``) or its
envd access token (``X-Access-Token``): a sandbox's ports are not open to whoever knows its id.
A websocket (an ASGI ``websocket`` scope: uvicorn took the ``Upgrade: websocket``) is relayed by
:mod:`.wsproxy` over the same kind of connection, counted as one forwarded request while it is
open. Other upgrades (``h2c``...) go on as plain HTTP/1.1, the ``Upgrade`` header dropped.
A sandbox has at most ``MAX_OPEN`` requests forwarded at once, and its connects take threads
of its share of the pool (:mod:`..shares`); past either, 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
from starlette.types import Receive, Scope, Send

from ...errors import BunshinError, NotFound, RateLimited, Unreachable
from ..context import ServerContext
from . import wsproxy
from .hosts import refuse, register_other_ports, target, traffic_ok

#: Headers that belong to one hop (RFC 9110 7.6.1) and are not sent on either way.
HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                 b"upgrade", b"x-access-token", b"e2b-traffic-access-token", b"e2b-sandbox-id",
                 b"e2b-sandbox-port"})
READ = 1 << 16
#: Seconds to wait for the server inside to answer at all.
CONNECT_TIMEOUT_S = 5.0
#: Requests one sandbox may have forwarded at once, an open websocket one of them (each holds
#: two of the server's descriptors, and its connect a thread of the sandbox's share of the pool).
MAX_OPEN = 128


class PortProxy:
    """The ASGI app of every sandbox port no other app is registered for."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._open: dict[str, int] = {}  # requests being forwarded, by sandbox (the event loop's thread only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t = target(scope)
        if not traffic_ok(self.ctx.token, scope):
            await refuse(scope, send, 401, f"missing or wrong access token for sandbox {t.sandbox_id}: send its "
                                           "trafficAccessToken as E2B-Traffic-Access-Token (or its "
                                           "envdAccessToken as X-Access-Token)")
            return
        n = self._open.get(t.sandbox_id, 0)
        if n >= MAX_OPEN:
            await refuse(scope, send, 429, f"the sandbox {t.sandbox_id} has {MAX_OPEN} requests being forwarded: "
                                           "retry when some have ended")
            return
        self._open[t.sandbox_id] = n + 1
        try:
            await self._proxy(scope, receive, send)
        finally:
            if self._open[t.sandbox_id] <= 1:
                del self._open[t.sandbox_id]
            else:
                self._open[t.sandbox_id] -= 1

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        t = target(scope)
        try:
            sock = await self.ctx.shares.run(t.sandbox_id, self._connect, t.sandbox_id, t.port)
        except RateLimited as e:
            await refuse(scope, send, 429, e.message)
            return
        except NotFound:
            await refuse(scope, send, 502, f"The sandbox {t.sandbox_id} was not found")
            return
        except Unreachable:
            await refuse(scope, send, 502, f"The sandbox {t.sandbox_id} is running but port {t.port} is not open")
            return
        except BunshinError as e:
            await refuse(scope, send, 502, f"The sandbox {t.sandbox_id} cannot be reached: {e.message}")
            return
        if scope["type"] == "websocket":
            await wsproxy.relay(scope, receive, send, sock, t.port)
            return
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            await _forward(scope, receive, send, reader, writer, t.port)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _connect(self, sandbox_id: str, port: int) -> socket.socket:
        return self.ctx.ws_of(sandbox_id).connect_port(port, timeout=CONNECT_TIMEOUT_S)


async def _forward(scope: Scope, receive: Receive, send: Send, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, port: int) -> None:
    conn = h11.Connection(our_role=h11.CLIENT)
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP and k.lower() != b"host"]
    headers += [(b"host", f"127.0.0.1:{port}".encode()), (b"connection", b"close")]
    if not any(k.lower() == b"content-length" for k, _ in headers) and scope["method"] not in ("GET", "HEAD"):
        headers.append((b"transfer-encoding", b"chunked"))
    path = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        path += b"?" + scope["query_string"]
    writer.write(conn.send(h11.Request(method=scope["method"], target=path, headers=headers)))
    more = True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        if msg.get("body"):
            writer.write(conn.send(h11.Data(data=msg["body"])))
            await writer.drain()
        more = msg.get("more_body", False)
    writer.write(conn.send(h11.EndOfMessage()))
    await writer.drain()
    await _answer(conn, send, reader)


async def _answer(conn: h11.Connection, send: Send, reader: asyncio.StreamReader) -> None:
    started = False
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(READ))
            continue
        if isinstance(event, h11.Response):
            headers = [(k, v) for k, v in event.headers if k.lower() not in HOP]
            await send({"type": "http.response.start", "status": event.status_code, "headers": headers})
            started = True
        elif isinstance(event, h11.Data):
            await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                body = b'{"code": 502, "message": "the server inside closed the connection without answering"}'
                await send({"type": "http.response.start", "status": 502,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": body})
            return


register_other_ports(PortProxy)
