"""Websockets to a port inside a sandbox: ``get_host(port)`` for a Jupyter kernel, a dev
server's hot reload, a VNC stream.

Two websockets, relayed message by message. The client's is the server's own (uvicorn with
the ``websockets`` package does its handshake, framing and pings; an ASGI ``websocket``
scope). The other goes from the host to the port inside the sandbox, over the TCP socket
``Workspace.connect_port`` made in the sandbox's network namespace (``websockets``' asyncio
client, no proxy, no compression on that loopback). The subprotocols the client offers are
offered inside and the one the server inside picks is the one accepted; a server inside
that refuses the upgrade has its HTTP status, headers and body passed back (ASGI's
``websocket.http.response``). Text stays text and binary binary; a close code is passed on
either way (one that may not be sent, 1005/1006, as 1001 going up and 1014, bad gateway,
coming down: a sandbox killed mid-stream closes its client with 1014).

Bounds: a message at most :data:`MAX_MESSAGE` bytes each way (uvicorn's ``ws_max_size``
default going up, the inside client's ``max_size`` coming down; larger closes with 1009);
the server holds about five messages of a websocket at most (uvicorn's one queued and the
one being sent in; :data:`MAX_QUEUE` frames queued coming out and the one being sent on),
and stops reading a side until the other has taken them (backpressure); each hop pings its peer every 20 s and drops it after 20 s without an
answer, so a vanished client or sandbox ends both within ~40 s; a socket open counts as
one of the sandbox's forwarded connections (``portproxy.MAX_OPEN``) until both are closed.
No thread is held while a websocket is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI, WebSocketException

from .hosts import refuse

#: Largest message either way (bytes; uvicorn's ``ws_max_size`` default, the client's side).
MAX_MESSAGE = 16 << 20
#: Messages the inside hop holds before its reader waits for the client to take them.
MAX_QUEUE = 2
#: Seconds: the handshake inside, and a closing handshake's wait before the socket goes.
OPEN_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 2.0
#: Seconds between pings on the inside hop, and to wait for the pong.
PING_S = 20.0
#: Close code for a connection inside that ended without a close frame (RFC 6455 registry).
BAD_GATEWAY = 1014
GOING_AWAY = 1001
#: Headers not sent on into the sandbox: one hop's, the tokens, and the handshake's own.
_NOT_ON = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                     "upgrade", "x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id", "e2b-sandbox-port",
                     "host", "origin", "user-agent", "content-length"})
#: Headers of the inside's handshake answer not passed back (the server's own, and one hop's).
_NOT_BACK = frozenset({"connection", "upgrade", "keep-alive", "transfer-encoding", "content-length", "date",
                       "server"})


def sendable(code: int) -> bool:
    """Whether ``code`` may be put in a close frame (RFC 6455 7.4: not 1005, 1006, 1015)."""
    return code in (1000, 1001, 1002, 1003) or 1007 <= code <= 1014 or 3000 <= code <= 4999


async def relay(scope: Scope, receive: Receive, send: Send, sock: socket.socket, port: int) -> None:
    """Carry the websocket of ``scope`` into the sandbox over ``sock`` (connected to
    ``port`` inside; closed here, whatever happens) until either side closes."""
    try:
        if (await receive())["type"] != "websocket.connect":
            return
        inside = await _open_inside(scope, send, sock, port)
        if inside is None:
            return
        try:
            with contextlib.suppress(OSError):  # a client gone meanwhile: nothing to relay
                await send({"type": "websocket.accept", "subprotocol": inside.subprotocol,
                            "headers": _back(inside.response.headers.raw_items() if inside.response else [])})
                await _pump(receive, send, inside)
        finally:
            await inside.close(GOING_AWAY)
            inside.transport.abort()
    finally:
        sock.close()  # a no-op once the transport owns (and has closed) it


async def _open_inside(scope: Scope, send: Send, sock: socket.socket, port: int) -> ClientConnection | None:
    """The websocket to ``port`` inside, or None when the client was answered instead."""
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    sent_on = [(k, v) for k, v in headers if k.lower() not in _NOT_ON and not k.lower().startswith("sec-websocket-")]
    origin = next((v for k, v in headers if k.lower() == "origin"), None)
    agent = next((v for k, v in headers if k.lower() == "user-agent"), None)
    try:
        return await connect(
            f"ws://127.0.0.1:{port}{path}", sock=sock, proxy=None, compression=None,
            subprotocols=scope.get("subprotocols") or None, additional_headers=sent_on,
            origin=origin, user_agent_header=agent,
            open_timeout=OPEN_TIMEOUT_S, close_timeout=CLOSE_TIMEOUT_S, ping_interval=PING_S, ping_timeout=PING_S,
            max_size=MAX_MESSAGE, max_queue=MAX_QUEUE)
    except InvalidStatus as e:  # the server inside answered, without upgrading: its answer goes back
        await _answer(scope, send, e.response.status_code, e.response.headers.raw_items(),
                      bytes(e.response.body or b""))
    except InvalidURI:
        await refuse(scope, send, 400, "the websocket's path is not one a URI can hold")
    except (WebSocketException, OSError, TimeoutError) as e:
        await refuse(scope, send, 502, f"the server inside on port {port} did not take the websocket: "
                                       f"{type(e).__name__}: {e}"[:300])
    return None


async def _answer(scope: Scope, send: Send, status: int, headers: Any, body: bytes) -> None:
    if "websocket.http.response" not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": 1008, "reason": f"the server inside answered {status}"})
        return
    await send({"type": "websocket.http.response.start", "status": status, "headers": _back(headers)})
    await send({"type": "websocket.http.response.body", "body": body})


def _back(headers: Any) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers
            if k.lower() not in _NOT_BACK and not k.lower().startswith("sec-websocket-")]


async def _pump(receive: Receive, send: Send, inside: ClientConnection) -> None:
    """Messages both ways until one side ends. A client that leaves stops the relay at once;
    a sandbox side that ends lets its close reach the client first (bounded)."""
    up = asyncio.ensure_future(_up(receive, inside))
    down = asyncio.ensure_future(_down(send, inside))
    try:
        await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
        if up.done() and not up.cancelled() and isinstance(up.exception(), ConnectionClosed):
            await asyncio.wait((down,), timeout=CLOSE_TIMEOUT_S)  # the inside went while a message went in
    finally:
        for task in (up, down):
            task.cancel()
        for task in (up, down):
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, OSError, RuntimeError):
                await task


async def _up(receive: Receive, inside: ClientConnection) -> None:
    """Client to sandbox; a client that leaves closes the inside with its code (or 1001)."""
    while True:
        msg = await receive()
        if msg["type"] == "websocket.receive":
            text = msg.get("text")
            await inside.send(text if text is not None else msg.get("bytes") or b"")
        elif msg["type"] == "websocket.disconnect":
            code = int(msg.get("code") or 1005)
            await inside.close(code if sendable(code) else GOING_AWAY, str(msg.get("reason") or "")[:120])
            return


async def _down(send: Send, inside: ClientConnection) -> None:
    """Sandbox to client; then the inside's close goes on: the code the server inside sent,
    else the one this side failed the connection with (1009 for a message too large), else
    1014 (it just ended)."""
    closed: ConnectionClosed | None = None
    try:
        async for data in inside:
            if isinstance(data, str):
                await send({"type": "websocket.send", "text": data})
            else:
                await send({"type": "websocket.send", "bytes": data})
    except ConnectionClosed as e:
        closed = e
    frame = (closed.rcvd or closed.sent) if closed is not None else None
    if frame is not None:
        code, reason = frame.code, frame.reason
    else:
        code, reason = inside.close_code or 1006, inside.close_reason or ""
    if not sendable(code):
        code, reason = (1000, "") if code == 1005 else (BAD_GATEWAY, "the connection inside the sandbox ended")
    await send({"type": "websocket.close", "code": code, "reason": reason[:120]})
