"""OSWorld's contract on bunshin desktops: the DesktopEnv (reset restores the task's
snapshot), its two action spaces, its evaluators, and the in-workspace VM server driven
over real HTTP from the host through the loopback forward."""

from __future__ import annotations

import io
import shutil
import socket
import subprocess
import time

import httpx
import pytest
from PIL import Image, ImageChops

from bunshin.adapters.osworld import DesktopEnv
from bunshin.errors import InvalidArgument
from bunshin.workspace.desktop import Desktop, forward_command

pytestmark = [
    pytest.mark.integration,
    pytest.mark.criu,
    pytest.mark.skipif(any(shutil.which(p) is None for p in ("Xvfb", "jwm", "xdotool", "xterm", "socat")),
                       reason="needs xvfb, x11-apps, xdotool, jwm, xterm and socat: run `make install`"),
]

TASK = {
    "id": "write-hello",
    "instruction": "In the terminal, write hello into /root/out.txt",
    "config": [
        {"type": "execute", "parameters": {"command": ["sh", "-c", "echo notes > /root/notes.txt"]}},
        {"type": "launch", "parameters": {"command": ["xterm", "-geometry", "60x10+0+0"]}},
        {"type": "sleep", "parameters": {"seconds": 0.3}},
    ],
    "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/root/out.txt"},
                  "expected": {"type": "rule", "rules": {"expected": "hello\n"}}},
}


def _same(a: bytes, b: bytes) -> bool:
    return ImageChops.difference(Image.open(io.BytesIO(a)).convert("RGB"),
                                 Image.open(io.BytesIO(b)).convert("RGB")).getbbox() is None


def test_reset_restores_the_tasks_snapshot_and_evaluate_scores_the_episode(no_leaks):
    with DesktopEnv(desktop="640x480", config=no_leaks, memory="1G") as env:
        obs = env.reset(TASK)
        assert obs["instruction"] == TASK["instruction"] and obs["accessibility_tree"] is None
        assert Image.open(io.BytesIO(obs["screenshot"])).size == (640, 480)
        assert "build_s" in env.timings and env.evaluate() == 0.0
        for action in ({"action_type": "CLICK", "parameters": {"x": 100, "y": 60}},
                       {"action_type": "TYPING", "parameters": {"text": "echo hello > /root/out.txt"}},
                       {"action_type": "PRESS", "parameters": {"key": "enter"}}):
            obs, reward, done, info = env.step(action)
            assert not done and "error" not in info
        assert env.evaluate() == 1.0
        _, _, done, _ = env.step("DONE")
        assert done
        first_ws = env.ws
        again = env.reset(TASK)  # the same task: its snapshot, not a second setup
        assert env.ws is not first_ws and env.timings["restore_s"] < env.timings["build_s"]
        assert env.evaluate() == 0.0 and _same(again["screenshot"], env.reset()["screenshot"])
        assert _same(again["screenshot"], obs["screenshot"]) is False  # the typed command is not there


def test_pyautogui_action_space_and_bad_actions(no_leaks):
    with DesktopEnv(desktop="640x480", config=no_leaks, memory="1G", action_space="pyautogui") as env:
        env.reset(TASK)
        obs, _, done, info = env.step("pyautogui.click(100, 60); pyautogui.write('echo hello > /root/out.txt');"
                                      " pyautogui.press('enter'); print(pyautogui.size())")
        assert not done and info["output"].strip() == "(640, 480)" and env.evaluate() == 1.0
        _, _, _, info = env.step("pyautogui.notAFunction()")
        assert "not provided by bunshin's stand-in" in info["error"]
        _, _, done, _ = env.step("FAIL")
        assert done and env.evaluate() == 0.0  # gave up: a feasible task scores 0
    with DesktopEnv(desktop="640x480", config=no_leaks, memory="1G") as env:
        env.reset(TASK)
        before = env.step("WAIT")[0]["screenshot"]
        for bad, words in (({"action_type": "CLICK", "parameters": {"x": 640, "y": 0}}, "off the 640x480 screen"),
                           ({"action_type": "PRESS", "parameters": {"key": "hyperkey"}}, "unknown key"),
                           ({"action_type": "TELEPORT"}, "unknown computer_13 action"),
                           ({"action_type": "HOTKEY", "parameters": {"keys": "ctrl"}}, "a list"),
                           ("click", "an object")):
            obs, _, done, info = env.step(bad)
            assert not done and words in info["error"], (bad, info)
        assert _same(obs["screenshot"], before)


def test_bad_task_configs_are_refused_before_anything_runs(no_leaks):
    with DesktopEnv(desktop="320x240", config=no_leaks, memory="1G") as env:
        with pytest.raises(InvalidArgument, match="setup type 'reboot'"):
            env.reset({"id": "x", "config": [{"type": "reboot", "parameters": {}}]})
        with pytest.raises(InvalidArgument, match="func 'chess_eval'"):
            env.reset({"id": "x", "config": [], "evaluator": {"func": "chess_eval", "result": {"type": "rule"}}})
        with pytest.raises(InvalidArgument, match="action_space"):
            DesktopEnv(action_space="voice")
        with pytest.raises(InvalidArgument, match="reset first|task config"):
            env.reset()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_osworld_server_endpoints_over_http_from_the_host(family):
    ws = family.create(desktop="640x480")
    desk = Desktop.of(ws)
    desk.start_osworld()
    port = _free_port()
    fwd = subprocess.Popen(forward_command(ws.record.pid, 5000, port), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{base}/platform", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        with httpx.Client(base_url=base, timeout=30) as c:
            shot = c.get("/screenshot")
            assert shot.status_code == 200 and shot.headers["content-type"] == "image/png"
            assert _same(shot.content, desk.screenshot())  # the server's PNG is the desktop's pixels
            assert c.get("/platform").text == "Linux"
            assert c.post("/screen_size").json() == {"width": 640, "height": 480}
            r = c.post("/execute", json={"command": ["sh", "-c", "echo $DISPLAY; echo e >&2; exit 3"]}).json()
            assert r == {"status": "success", "output": ":0\n", "error": "e\n", "returncode": 3}
            r = c.post("/setup/execute", json={"command": "echo shell-form", "shell": True}).json()
            assert r["output"] == "shell-form\n"
            assert "launched successfully" in c.post("/setup/launch", json={"command": ["xterm"]}).text
            code = "import pyautogui; pyautogui.moveTo(10, 20); print(pyautogui.position())"
            assert c.post("/execute", json={"command": ["python3", "-c", code]}).json()["output"] == "(10, 20)\n"
            assert c.get("/cursor_position").json() == [10, 20]
            r = c.post("/setup/upload", data={"file_path": "/root/up/a.txt"}, files={"file_data": ("a.txt", b"up!")})
            assert r.status_code == 200 and ws.files.read("/root/up/a.txt") == b"up!"
            assert c.post("/file", data={"file_path": "/root/up/a.txt"}).content == b"up!"
            assert c.post("/file", data={"file_path": "/nope"}).status_code == 404
            assert c.post("/list_directory", json={"path": "/root/up"}).json()["directory_tree"]["children"] == [
                {"type": "file", "name": "a.txt"}]
            r = c.post("/run_python", json={"code": "print(6 * 7)"}).json()
            assert r["status"] == "success" and r["output"] == "42\n"
            r = c.post("/run_bash_script", json={"script": "echo $((1+1)); exit 4"}).json()
            assert (r["output"], r["returncode"], r["status"]) == ("2\n", 4, "error")
            ws.files.write("/root/n.txt", "x")
            assert c.post("/setup/open_file", json={"path": "/root/n.txt", "timeout_seconds": 10}).status_code == 200
            assert c.post("/setup/activate_window", json={"window_name": "xterm"}).status_code == 200
            assert c.post("/setup/activate_window", json={"window_name": "no such"}).status_code == 404
            acc = c.get("/accessibility")
            assert acc.status_code == 501 and "AT-SPI" in acc.json()["message"]
            assert c.post("/nope", json={}).status_code == 404
            assert c.post("/execute", content=b"[1, 2]").status_code == 500  # not an object: an answer, no crash
            assert c.get("/platform").status_code == 200
    finally:
        fwd.terminate()
        fwd.wait(10)


def test_the_osworld_server_forks_with_the_task_snapshot(no_leaks):
    """Started before the snapshot, the server's listening socket is in every restore."""
    probe = ("import json, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
             "'http://127.0.0.1:5000/screen_size', method='POST')); print(json.load(r))")
    with DesktopEnv(desktop="320x240", config=no_leaks, memory="1G", osworld_server=True) as env:
        for _ in range(2):
            env.reset({"id": "server", "config": []})
            assert env.ws is not None
            assert env.ws.exec(["python3", "-c", probe]).stdout.strip() == "{'width': 320, 'height': 240}"
