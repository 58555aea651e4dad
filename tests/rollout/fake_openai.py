"""A tiny OpenAI-compatible chat-completions server on 127.0.0.1, for tests.

It answers with the tool calls of ``script`` in order (one list per turn, chosen by
how many tool results the request already holds), then a final message. ``fail_first``
requests get a 503 first, to exercise retries.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeChatServer:
    def __init__(self, script: list[list[dict[str, Any]]], *, fail_first: int = 0, final: str = "done") -> None:
        self.script, self.fail_left, self.final = script, fail_first, final
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append({"path": self.path, "body": body,
                                            "auth": self.headers.get("Authorization")})
                    fail = server.fail_left > 0
                    server.fail_left -= fail
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "not found"})
                if fail:
                    return self._send(503, {"error": "overloaded"})
                turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
                if turn < len(server.script):
                    calls = [{"id": f"c{turn}-{i}", "type": "function",
                              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                             for i, c in enumerate(server.script[turn])]
                    msg = {"role": "assistant", "content": None, "tool_calls": calls}
                else:
                    msg = {"role": "assistant", "content": server.final}
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})

            def _send(self, status: int, obj: dict[str, Any]) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
