"""A websocket echo server run INSIDE a sandbox by test_wsproxy.py (its ``websockets`` package
is copied in): echoes text as text and bytes as bytes; ``count?`` answers how many
connections are open, what the handshake carried and how the last one closed; ``big <n>`` sends n bytes; ``close <code>`` closes with that code;
the path ``/forbidden`` is refused with 403."""

from __future__ import annotations

import asyncio
import json
import sys
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection, serve

open_now = 0
last_close: list[object] = []  # the close code and reason of the connection that ended last


async def handler(ws: ServerConnection) -> None:
    global open_now
    open_now += 1
    try:
        async for msg in ws:
            if msg == "count?":
                h = ws.request.headers if ws.request else {}
                await ws.send(json.dumps({"open": open_now, "subprotocol": ws.subprotocol,
                                          "path": ws.request.path if ws.request else None,
                                          "cookie": h.get("Cookie"), "token": h.get("E2B-Traffic-Access-Token"),
                                          "last_close": last_close}))
            elif isinstance(msg, str) and msg.startswith("big "):
                await ws.send(b"\0" * int(msg.split()[1]))
            elif isinstance(msg, str) and msg.startswith("close "):
                await ws.close(int(msg.split()[1]), "asked to")
            else:
                await ws.send(msg)
    finally:
        open_now -= 1
        last_close[:] = [ws.close_code, ws.close_reason]


def refuse(ws: ServerConnection, request):  # noqa: ANN001, ANN201
    if request.path == "/forbidden":
        return ws.respond(HTTPStatus.FORBIDDEN, "not here\n")
    return None


def subprotocol(ws: ServerConnection, offered):  # noqa: ANN001, ANN201
    return "echo.v1" if "echo.v1" in offered else None


async def main() -> None:
    async with serve(handler, "127.0.0.1", int(sys.argv[1]), process_request=refuse,
                     select_subprotocol=subprotocol, max_size=8 << 20):
        print("listening", flush=True)
        await asyncio.Future()


asyncio.run(main())
