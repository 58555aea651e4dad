"""The code interpreter checks a sandbox's token before it reads a request's body: a caller
without one cannot make the server buffer a body for it."""

from __future__ import annotations

import asyncio
from typing import Any

from bunshin.errors import WorkspaceNotFound
from bunshin.server.e2b.interpreter.app import make_interpreter_app


def _nowhere(sid: str) -> Any:
    raise WorkspaceNotFound(f"no {sid}")


def test_a_caller_without_a_token_has_no_body_read() -> None:
    app = make_interpreter_app(_nowhere, server_token="t" * 32)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read before the token was checked")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/execute", "raw_path": b"/execute",
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("127.0.0.1", 80),
             "headers": [(b"e2b-sandbox-id", b"ws-000000000001"), (b"content-type", b"application/json"),
                         (b"content-length", str(1 << 20).encode())]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
    assert b"access token" in b"".join(m.get("body", b"") for m in sent[1:])
