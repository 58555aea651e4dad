"""Websockets to a port inside a sandbox, through ``get_host(port)``: a real websocket echo server
inside a sandbox the unmodified e2b SDK made, a real websocket client over loopback naming
``<port>-<sandbox id>.<domain>`` in its Host header (the socket goes to 127.0.0.1, so no name is
resolved and /etc/hosts is not touched). Messages both ways, text and binary; subprotocols;
the inside's refusal and close codes passed on; the token checked; a client that hangs up
frees its slot and closes the connection inside; a sandbox killed mid-stream closes its client."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

pytest.importorskip("e2b")
websockets = pytest.importorskip("websockets")
from e2b import Sandbox  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import ClientConnection, connect  # noqa: E402

from bunshin.config import Config  # noqa: E402
from bunshin.server.e2b import portproxy, wsproxy  # noqa: E402
from bunshin.server.e2b.auth import traffic_access_token  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import drop_everything  # noqa: E402
from .ws_inside import start_echo  # noqa: E402

pytestmark = pytest.mark.integration
TOKEN = "test-token-wsproxy-0123456789"
PORT = 8765


@pytest.fixture(scope="module")
def rig(cfg: Config) -> Iterator[tuple[str, Sandbox]]:
    """One server and one sandbox running the echo server (the last test kills it)."""
    with serve_in_thread(cfg, TOKEN) as url:
        sbx = Sandbox.create(api_url=url, sandbox_url=url, api_key=TOKEN, timeout=300)
        try:
            start_echo(sbx, PORT)
            deadline = time.monotonic() + 20
            while True:  # until the server inside listens
                try:
                    with _ws(url, sbx):
                        break
                except InvalidStatus as e:
                    assert e.response.status_code == 502 and time.monotonic() < deadline, e
                    time.sleep(0.1)
            yield url, sbx
        finally:
            drop_everything(url, TOKEN)
    assert leftovers(cfg) == {}


def _ws(url: str, sbx: Sandbox, *, port: int = PORT, path: str = "/echo", token: str | None = "own",
        extra: dict[str, str] | None = None, **kw: Any) -> ClientConnection:
    """A websocket to ``get_host(port)`` of ``sbx``, its socket connected to the server's port."""
    host = sbx.get_host(port)
    assert host.startswith(f"{port}-{sbx.sandbox_id}.localhost:")
    server_port = int(url.rsplit(":", 1)[1])
    headers = {} if token is None else {
        "E2B-Traffic-Access-Token": sbx.traffic_access_token if token == "own" else token}
    headers.update(extra or {})
    sock = socket.create_connection(("127.0.0.1", server_port))
    try:
        return connect(f"ws://{host}{path}", sock=sock, additional_headers=headers, proxy=None, open_timeout=10,
                       close_timeout=2, **kw)
    except BaseException:
        sock.close()
        raise


def _count(ws: ClientConnection) -> dict[str, Any]:
    ws.send("count?")
    got = ws.recv(timeout=10)
    assert isinstance(got, str)
    out: dict[str, Any] = json.loads(got)
    return out


def test_messages_both_ways_text_and_binary(rig) -> None:
    url, sbx = rig
    with _ws(url, sbx, path="/echo?x=1", subprotocols=["nope", "echo.v1"], extra={"Cookie": "a=b"}) as ws:
        assert ws.subprotocol == "echo.v1"
        ws.send("héllo, sandbox")
        assert ws.recv(timeout=10) == "héllo, sandbox"
        blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
        ws.send(blob)
        assert ws.recv(timeout=10) == blob
        for i in range(50):  # many small ones, in order
            ws.send(f"m{i}")
        assert [ws.recv(timeout=10) for _ in range(50)] == [f"m{i}" for i in range(50)]
        seen = _count(ws)
        assert (seen["subprotocol"], seen["path"], seen["cookie"]) == ("echo.v1", "/echo?x=1", "a=b")
        assert seen["token"] is None  # the sandbox's token stays with the server
        ws.send("close 4001")  # the inside's close code comes through
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4001 and ws.close_reason == "asked to"
    with _ws(url, sbx) as ws:  # and the client's goes in
        ws.close(4002, "client done")
    with _ws(url, sbx) as ws:  # the close inside follows the client's own: looked for, within a bound
        deadline = time.monotonic() + 10
        while _count(ws)["last_close"] != [4002, "client done"]:
            assert time.monotonic() < deadline, _count(ws)
            time.sleep(0.05)


def test_a_message_too_large_either_way_closes_with_1009(rig) -> None:
    url, sbx = rig
    with _ws(url, sbx, max_size=None) as ws:
        ws.send(f"big {wsproxy.MAX_MESSAGE}")  # the largest passes
        assert len(ws.recv(timeout=30)) == wsproxy.MAX_MESSAGE
        ws.send(f"big {wsproxy.MAX_MESSAGE + 1}")
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1009
    with _ws(url, sbx) as ws:
        ws.send(b"\0" * (wsproxy.MAX_MESSAGE + 1))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == 1009


def test_the_token_is_checked(rig) -> None:
    url, sbx = rig
    for token in (None, "wrong", traffic_access_token(TOKEN, "ws-000000000000")):
        with pytest.raises(InvalidStatus) as refused:
            _ws(url, sbx, token=token)
        assert refused.value.response.status_code == 401
        assert "access token" in json.loads(refused.value.response.body)["message"]


def test_refusals_inside_and_a_closed_port(rig) -> None:
    url, sbx = rig
    with pytest.raises(InvalidStatus) as forbidden:
        _ws(url, sbx, path="/forbidden")
    assert (forbidden.value.response.status_code, forbidden.value.response.body) == (403, b"not here\n")
    with pytest.raises(InvalidStatus) as closed:
        _ws(url, sbx, port=PORT + 1)
    assert closed.value.response.status_code == 502
    assert f"port {PORT + 1} is not open" in json.loads(closed.value.response.body)["message"]


def test_a_client_that_hangs_up_frees_its_slot(rig, monkeypatch) -> None:
    """With two slots: both taken, a third refused (429); one client vanishes without a close
    frame; its connection inside is closed and its slot is free again."""
    url, sbx = rig
    monkeypatch.setattr(portproxy, "MAX_OPEN", 2)
    with ExitStack() as stack:
        a, b = stack.enter_context(_ws(url, sbx)), stack.enter_context(_ws(url, sbx))
        assert _count(b)["open"] == 2
        with pytest.raises(InvalidStatus) as full:
            _ws(url, sbx)
        assert full.value.response.status_code == 429
        a.socket.shutdown(socket.SHUT_RDWR)  # the client goes, no close frame
        a.socket.close()
        deadline = time.monotonic() + 10
        while _count(b)["open"] != 1:
            assert time.monotonic() < deadline, "the connection inside stayed open"
            time.sleep(0.05)
        deadline = time.monotonic() + 10
        while True:  # the slot comes back once the relay has ended
            try:
                c = stack.enter_context(_ws(url, sbx))
                break
            except InvalidStatus as e:
                assert e.response.status_code == 429 and time.monotonic() < deadline, "the slot stayed taken"
                time.sleep(0.05)
        assert _count(c)["open"] == 2


def test_a_sandbox_killed_mid_stream_closes_its_client(rig) -> None:
    url, sbx = rig
    with _ws(url, sbx) as ws:
        ws.send(b"\x00before")
        assert ws.recv(timeout=10) == b"\x00before"
        assert sbx.kill()
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        assert ws.close_code == wsproxy.BAD_GATEWAY
    with pytest.raises(InvalidStatus) as gone:
        _ws(url, sbx)
    assert gone.value.response.status_code == 502
