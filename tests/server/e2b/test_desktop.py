"""Integration: ``e2b_desktop.Sandbox`` (the unmodified SDK from PyPI) on ``bunshin serve``
over loopback: its create starts Xvfb and XFCE through envd in a sandbox of the ``desktop``
template (the host image), then screenshot, mouse, typing, keys and launch work on it."""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Iterator

import httpx
import pytest

e2b_desktop = pytest.importorskip("e2b_desktop")
from PIL import Image  # noqa: E402

from bunshin.config import Config  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(any(shutil.which(p) is None for p in ("Xvfb", "startxfce4", "scrot", "xdotool", "xrandr", "x11vnc", "websockify",
                                                             "gtk-launch", "dbus-launch", "xterm")),
                       reason="needs the e2b desktop's packages: run `make install`"),
]
TOKEN = "desktop-test-token-0123456789ab"


@pytest.fixture(scope="module")
def desk(cfg: Config) -> Iterator[object]:
    """One desktop sandbox for the module; it and its template go after, leaving nothing."""
    with serve_in_thread(cfg, TOKEN) as url:
        d = e2b_desktop.Sandbox.create(resolution=(800, 600), api_url=url, sandbox_url=url, api_key=TOKEN)
        try:
            yield d
        finally:
            d.kill()
            with httpx.Client(base_url=url, headers={"X-API-Key": TOKEN}, timeout=60) as c:
                for t in c.get("/templates").json():
                    c.delete(f"/templates/{t['templateID']}")
    assert not any(leftovers(cfg).values()), leftovers(cfg)


def _wait(probe, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while not (got := probe()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return got


def test_the_desktop_runs_with_the_sandbox_env(desk) -> None:
    assert desk.commands.run("echo $DISPLAY").stdout == ":0\n"  # create's envs reach every command
    assert desk.get_screen_size() == (800, 600)
    names = desk.commands.run("ps -eo comm").stdout.split()
    assert {"Xvfb", "xfce4-session", "xfwm4", "xfdesktop"} <= set(names)


def test_screenshot_mouse_typing_and_launch(desk) -> None:
    shot = desk.screenshot()
    assert bytes(shot[:8]) == b"\x89PNG\r\n\x1a\n" and Image.open(io.BytesIO(shot)).size == (800, 600)
    desk.move_mouse(123, 234)
    assert desk.get_cursor_position() == (123, 234)
    desk.launch("debian-xterm")
    window = _wait(lambda: desk.commands.run("xdotool search --onlyvisible --class xterm || true").stdout.split())
    desk.left_click(400, 300)  # focus the middle of the screen, where xfwm4 places the xterm
    desk.commands.run(f"xdotool windowactivate --sync {window[0]}")
    desk.write("echo typed-by-e2b > /tmp/typed", chunk_size=10, delay_in_ms=5)
    desk.press("enter")
    _wait(lambda: desk.files.exists("/tmp/typed"))
    assert desk.files.read("/tmp/typed") == "typed-by-e2b\n"
    assert bytes(desk.screenshot()) != bytes(shot)  # the xterm is drawn


def test_the_stream_serves_novnc_and_its_websocket_speaks_rfb(desk) -> None:
    """``stream.start()`` as E2B users call it: x11vnc and noVNC (from /opt/noVNC) inside, the
    page and noVNC's websocket reached through ``get_host(6080)`` on the server's one port;
    the websocket carries the VNC server's own greeting (RFB). ``stop`` ends both."""
    import socket

    from websockets.sync.client import connect

    desk.stream.start()
    try:
        url = desk.stream.get_url()
        host = desk.get_host(6080)
        assert url.startswith(f"https://{host}/vnc.html?") and host.startswith(f"6080-{desk.sandbox_id}.")
        server = "http://127.0.0.1:" + host.rsplit(":", 1)[1]  # the name is not resolved: Host says it
        token = {"E2B-Traffic-Access-Token": desk.traffic_access_token}
        with httpx.Client(base_url=server, headers={"Host": host, **token}, timeout=30) as c:
            page = c.get("/vnc.html")
        assert page.status_code == 200 and "noVNC" in page.text
        sock = socket.create_connection(("127.0.0.1", int(host.rsplit(":", 1)[1])))
        with connect(f"ws://{host}/websockify", sock=sock, additional_headers=token, subprotocols=["binary"],
                     proxy=None, open_timeout=15) as ws:
            greeting = ws.recv(timeout=15)
        assert bytes(greeting).startswith(b"RFB 003.")
    finally:
        desk.stream.stop()
    assert _wait(lambda: desk.commands.run("pgrep -x x11vnc || echo gone").stdout.strip() == "gone")
