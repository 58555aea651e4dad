"""The server's one upload budget: uploads in flight share the cap and the disk's room, an
upload refused changes nothing, and one that ends gives its bytes back; a request's body
spooled into it over real HTTP, refused by its Content-Length before a byte is read, and given
back when its client hangs up midway."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bunshin.errors import BunshinError, PayloadTooLarge, RateLimited, ResourceExhausted
from bunshin.server import uploads
from bunshin.server.thread import listening_socket
from bunshin.server.uploads import Uploads, spooled


def test_uploads_in_flight_share_the_cap(tmp_path):
    budget = Uploads(cap=100)
    with budget.open(tmp_path, what="snapshot") as a:
        a.check(60)
        with budget.open(tmp_path, what="file") as b:
            with pytest.raises(RateLimited, match="1 uploads in flight \\(60 bytes\\)") as e:
                b.check(50)
            assert e.value.details["retry_after"] > 0 and b.size == 0  # refused: nothing taken
            b.check(40)
            with pytest.raises(PayloadTooLarge, match="limit of 100"):  # never fits, whatever is in flight
                b.check(101)
        with budget.open(tmp_path, what="file") as c:  # b's bytes are back
            c.check(40)
            with pytest.raises(RateLimited):
                a.check(61)
    with budget.open(tmp_path) as d:
        d.check(100)


def test_uploads_in_flight_share_the_disk(tmp_path, monkeypatch):
    real = os.statvfs

    def disk_with(free: int):
        def statvfs(path):
            st = real(path)
            return type("St", (), {"f_bavail": (uploads.DISK_MARGIN + free) // st.f_frsize, "f_frsize": st.f_frsize})()
        return statvfs

    monkeypatch.setattr(uploads.os, "statvfs", disk_with(10 << 20))
    budget = Uploads(cap=None)
    with budget.open(tmp_path, what="snapshot", factor=2) as a:  # 4 MiB body: 4 more to unpack it
        a.check(4 << 20)
        with budget.open(tmp_path, what="snapshot", factor=2) as b:
            # alone it would fit (2 x 4 MiB of 10); with a's unpacked copy still to come it does not
            with pytest.raises(ResourceExhausted, match="still need"):
                b.check(4 << 20)
            b.check(2 << 20)
    with budget.open(tmp_path, what="snapshot", factor=2) as alone, \
            pytest.raises(ResourceExhausted, match="bunshin gc"):
        alone.check(6 << 20)  # 6 MiB and its unpacked 6: more than the 10 free


# --- a body received into the budget over real HTTP (uploads.spooled) -------------------------

LIMIT = 4 << 20


@pytest.fixture(scope="module")
def spool_server(tmp_path_factory) -> Iterator[tuple[str, Uploads, Path]]:
    """uvicorn on loopback serving one route that spools its body with ``uploads.spooled``
    (the helper of the workspace PUT and envd's uploads) in a budget of 6 MiB."""
    folder = tmp_path_factory.mktemp("spool")
    budget = Uploads(cap=6 << 20)

    async def put(request: Request) -> JSONResponse:
        try:
            async with spooled(budget, request, folder, limit=LIMIT, hint="send less") as body:
                return JSONResponse({"bytes": len(body.read())})
        except BunshinError as e:
            return JSONResponse(e.to_dict(), status_code=e.http_status)

    app = Starlette(routes=[Route("/", put, methods=["PUT"])])
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", budget, folder
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _put_headers(where: str, length: int) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(where, timeout=10)
    conn.putrequest("PUT", "/")
    conn.putheader("Content-Length", str(length))
    conn.endheaders()
    return conn


def _until(ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not ok():
        assert time.monotonic() < deadline, "not reached in 10 s"
        time.sleep(0.01)


def test_a_body_is_spooled_whole_within_the_budget(spool_server) -> None:
    where, budget, folder = spool_server
    r = httpx.put(f"http://{where}/", content=b"x" * (3 << 20))
    assert r.json() == {"bytes": 3 << 20} and budget.in_flight() == 0
    conn = _put_headers(where, LIMIT + 1)  # and not a byte of the body: refused unread, no hang
    answer = conn.getresponse()
    assert answer.status == 413 and json.loads(answer.read())["hint"] == "send less"
    conn.close()

    def chunked() -> Iterator[bytes]:  # no Content-Length: refused once past the limit
        for _ in range(5):
            yield b"y" * (1 << 20)

    r = httpx.put(f"http://{where}/", content=chunked())
    assert r.status_code == 413 and "over the 4194304 bytes" in r.json()["message"]
    assert budget.in_flight() == 0 and not list(folder.iterdir())


def test_a_body_midway_holds_its_bytes_and_a_hang_up_gives_them_back(spool_server) -> None:
    where, budget, folder = spool_server
    conn = _put_headers(where, 4 << 20)
    conn.send(b"a" * (3 << 20))  # past the MiB in memory: on the disk
    _until(lambda: budget.in_flight() >= 3 << 20)
    r = httpx.put(f"http://{where}/", content=b"b" * (4 << 20))  # 3 + 4 MiB > the 6 in the budget
    assert r.status_code == 429 and r.json()["code"] == "rate_limited"
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client hangs up midway
    conn.close()
    _until(lambda: budget.in_flight() == 0)
    assert not list(folder.iterdir())  # its spool is gone with it
    assert httpx.put(f"http://{where}/", content=b"b" * (4 << 20)).json() == {"bytes": 4 << 20}
