"""Integration: a desktop inside a workspace (real Xvfb, jwm, xdotool, apps from Debian)."""

from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
from PIL import Image

from bunshin import Workspace
from bunshin.errors import InvalidArgument, StateConflict
from bunshin.workspace.desktop import Desktop, DesktopSpec

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("Xvfb") is None or shutil.which("jwm") is None,
                       reason="needs xvfb, x11-apps, xdotool and jwm: run `make install`"),
]


def _image(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png))


def test_desktop_starts_with_its_screen_and_apps_show(family):
    ws = family.create(desktop="640x480")
    desk = Desktop.of(ws)
    assert desk.spec == DesktopSpec(width=640, height=480)
    before = desk.screenshot()
    assert before.startswith(b"\x89PNG") and _image(before).size == (640, 480)
    assert desk.windows() == []
    desk.launch(["xterm", "-geometry", "60x10+20+20"])
    assert desk.windows() == ["xterm"]
    after = desk.screenshot()
    assert after != before  # the xterm is drawn
    # only a window's area changed: the far corner is the same background
    assert _image(after).getpixel((630, 470)) == _image(before).getpixel((630, 470))
    assert {"Xvfb", "jwm", "xterm"} <= {p.name for p in ws.processes()}


def test_a_screen_larger_than_an_exec_answer_is_read_through_a_file(family):
    """3000x2000 at 32 bits a pixel is ~23 MiB of XWD, over the 16 MiB an exec may keep: the
    screenshot goes through a file in the workspace's /tmp (left behind by none)."""
    ws = family.create(desktop="3000x2000")
    assert _image(Desktop.of(ws).screenshot()).size == (3000, 2000)
    assert ws.exec(["sh", "-c", "ls -a /tmp | grep -c bunshin-shot"]).stdout.strip() == "0"


def test_x_server_is_private_to_the_workspace(family):
    """Xvfb listens on no TCP port, and its sockets are the workspace's own: another
    workspace on display :0 is a different screen."""
    a, b = family.create(desktop="320x240"), family.create(desktop="320x240")
    Desktop.of(a).launch(["xterm", "-geometry", "20x5+0+0"])
    assert Desktop.of(a).windows() == ["xterm"] and Desktop.of(b).windows() == []
    listening = a.exec(["sh", "-c", "cat /proc/net/tcp /proc/net/tcp6 | awk '$4 == \"0A\"' | wc -l"]).stdout
    assert listening.strip() == "0"


def test_input_outside_the_screen_and_unknown_keys_are_refused(family):
    desk = Desktop.of(family.create(desktop="320x240"))
    shot = desk.screenshot()
    for call in (lambda: desk.click(320, 10), lambda: desk.move(-1, 0), lambda: desk.drag(0, 0, 10, 240),
                 lambda: desk.click(1.5, 2), lambda: desk.press("ctrl+hyper"), lambda: desk.type_text(""),
                 lambda: desk.scroll(0), lambda: desk.click(5, 5, button=9)):
        with pytest.raises(InvalidArgument):
            call()
    with pytest.raises(InvalidArgument, match="no program"):
        desk.launch("no-such-app-here")
    with pytest.raises(InvalidArgument, match="no such file"):
        desk.open("/nowhere/file.txt")
    assert desk.screenshot() == shot  # nothing reached the screen


def test_a_workspace_without_a_desktop_says_how_to_get_one(family):
    ws = family.create()
    with pytest.raises(StateConflict) as e:
        Desktop.of(ws)
    assert "--desktop" in (e.value.hint or "")
    Desktop.start(ws, DesktopSpec(width=320, height=240))
    with pytest.raises(StateConflict, match="already has a desktop"):
        Desktop.start(ws)
    ws.files.write("/tmp/.bunshin-desktop/desktop.json", "{not json")
    with pytest.raises(StateConflict, match="not JSON"):
        Desktop.of(ws)


def test_bad_desktop_spec_creates_nothing(no_leaks):
    with pytest.raises(InvalidArgument, match="WIDTHxHEIGHT"):
        Workspace.create("host", config=no_leaks, desktop="big")
    assert Workspace.list(config=no_leaks) == []


def test_cli_create_screenshot_windows_vnc(no_leaks, tmp_path):
    from tests.cli.test_cli import bunshin

    cfg = no_leaks
    ws = json.loads(bunshin(cfg, "create", "--desktop", "400x300", "--json").stdout)
    try:
        r = json.loads(bunshin(cfg, "desktop", "launch", ws["id"], "--json", "--", "xterm").stdout)
        assert r["pid"] > 0
        assert json.loads(bunshin(cfg, "desktop", "windows", ws["id"], "--json").stdout) == {"windows": ["xterm"]}
        out = tmp_path / "s.png"
        r = json.loads(bunshin(cfg, "desktop", "screenshot", ws["id"], "-o", str(out), "--json").stdout)
        assert (r["width"], r["height"]) == (400, 300) and _image(out.read_bytes()).size == (400, 300)
        r = json.loads(bunshin(cfg, "desktop", "vnc", ws["id"], "--json").stdout)
        assert r["started"] and "nsenter --net=/proc/" in r["forward"] and r["vnc_port"] == 5900
        probe = "import socket; s=socket.create_connection(('127.0.0.1', 5900), 5); print(s.recv(12))"
        ws_obj = Workspace.get(ws["id"], config=cfg)
        assert "RFB 003.008" in ws_obj.exec(["python3", "-c", probe]).stdout  # x11vnc answers inside
        assert not json.loads(bunshin(cfg, "desktop", "vnc", ws["id"], "--json").stdout)["started"]
        r = json.loads(bunshin(cfg, "desktop", "osworld", ws["id"], "--json").stdout)
        assert r["started"] and r["port"] == 5000 and "TCP\\:127.0.0.1\\:5000" in r["forward"]
        assert not json.loads(bunshin(cfg, "desktop", "osworld", ws["id"], "--json").stdout)["started"]
        r = bunshin(cfg, "create", "--vnc", "--json", check=False)
        assert r.returncode != 0 and "--vnc needs --desktop" in r.stderr
    finally:
        bunshin(cfg, "rm", ws["id"])


def test_a_planted_xwd_lying_about_its_size_gets_a_clear_error(family):
    """The workspace is hostile: a program it plants in xwd's place (first on PATH) answers
    with a header claiming a 100000x100000 screen; the host refuses it without building it."""
    from bunshin.errors import RuntimeFailure

    ws = family.create(desktop="320x240")
    fake = ("#!/usr/bin/python3\nimport struct, sys\n"
            "h = [105, 7, 2, 24, 100000, 100000, 0, 0, 32, 0, 32, 32, 400000, 4, 0xff0000, 0xff00, 0xff, 8, 256, 0,"
            " 100000, 100000, 0, 0, 0]\n"
            "sys.stdout.buffer.write(struct.pack('>25I', *h) + b'root\\0' + b'\\0' * 4096)\n")
    ws.files.write("/usr/local/bin/xwd", fake, mode=0o755)
    with pytest.raises(RuntimeFailure, match="describes no screen|cut short"):
        Desktop.of(ws).screenshot()


@pytest.mark.criu
def test_a_desktop_on_a_remote_workspace_over_http(no_leaks):
    """Desktop and the desktop tools use only the workspace protocol: the same over HTTP,
    fork included."""
    from bunshin.client import Client
    from bunshin.server.thread import serve_in_thread
    from bunshin.tools import ToolSet

    token = "desktop-remote-token-0123456789"
    with serve_in_thread(no_leaks, token) as url, Client(url, token=token) as client:
        ws = client.create(memory="1G")
        try:
            desk = Desktop.start(ws, DesktopSpec(width=320, height=240))
            desk.launch("xterm")
            obs = ToolSet.desktop().run_sync(ws, "screenshot", {})
            assert obs.ok and _image(base64.b64decode(obs.images[0])).size == (320, 240)
            served = ws.run_tool("screenshot")  # the server's own tool route runs it too
            assert served.ok and _image(base64.b64decode(served.images[0])).size == (320, 240)
            assert "off the 320x240 screen" in (ws.run_tool("left_click", {"x": 999, "y": 5}).error or "")
            (clone,) = ws.fork(1)
            try:
                assert Desktop.of(clone).windows() == ["xterm"]
                assert Desktop.of(clone).screenshot() == desk.screenshot()
            finally:
                clone.remove()
        finally:
            ws.remove()
