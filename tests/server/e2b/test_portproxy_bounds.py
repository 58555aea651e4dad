"""A sandbox has at most ``MAX_OPEN`` requests forwarded to its ports at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from bunshin.server.e2b import hosts, portproxy
from bunshin.server.e2b.auth import traffic_access_token

TOKEN = "t" * 32
SID = "ws-000000000001"


def _call(proxy: portproxy.PortProxy) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "headers": [
        (b"e2b-traffic-access-token", traffic_access_token(TOKEN, SID).encode())],
        hosts.SCOPE_KEY: hosts.Target(SID, 8080, by_host=False)}
    asyncio.run(proxy(scope, receive, send))
    return sent


def test_requests_forwarded_at_once_are_bounded_per_sandbox() -> None:
    proxy = portproxy.PortProxy(SimpleNamespace(token=TOKEN))  # type: ignore[arg-type]
    proxy._open[SID] = portproxy.MAX_OPEN
    sent = _call(proxy)
    assert sent[0]["status"] == 429
    assert proxy._open[SID] == portproxy.MAX_OPEN  # a refused request counts for nothing
