"""OSWorld's VM server contract, inside a desktop workspace (stdlib only).

``python3 -m bunshin_agent.osworld --port 5000`` (the agent's bundled Python) serves on
the workspace's loopback the endpoints OSWorld's ``PythonController`` and its setup
controller call on a VM (``desktop_env/server``): ``GET /screenshot`` (PNG),
``/accessibility``, ``/platform``, ``/cursor_position``, ``/terminal``; ``POST
/execute`` and ``/setup/execute`` (``{"command", "shell"}`` -> ``{"status", "output",
"error", "returncode"}``), ``/setup/launch``, ``/setup/open_file``,
``/setup/activate_window``, ``/setup/close_window``, ``/setup/upload`` (multipart
``file_path`` + ``file_data``), ``/setup/download_file``, ``/file`` (form
``file_path``), ``/screen_size``, ``/window_size``, ``/desktop_path``,
``/list_directory``, ``/run_python``, ``/run_bash_script``. Written from the contract's
facts, not from OSWorld's code: screenshots come from ``xwd``, input and windows from
``xdotool``. What this desktop cannot give answers 501 with a reason: the AT-SPI tree
(no accessibility bus runs here), the terminal's text, recording, the wallpaper.

Commands run with the desktop's ``DISPLAY`` and without the agent's Python settings;
when the image has no ``pyautogui`` (OSWorld's action code imports it), a small one
that drives xdotool is put on their ``PYTHONPATH`` (``pyautogui_shim``).
"""

import argparse
import email.parser
import email.policy
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

STATE_FILE = "/tmp/.bunshin-desktop/desktop.json"
SHIM_DIR = "/tmp/.bunshin-desktop/pyautogui"
MAX_BODY = 512 * 1024 * 1024
COMMAND_TIMEOUT = 120


def desktop_env() -> dict:
    """The environment of the desktop's programs: the image's, with the desktop's display."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    display = 0
    try:
        with open(STATE_FILE) as f:
            display = int(json.load(f).get("display", 0))
    except (OSError, ValueError, TypeError):
        pass
    env.update(DISPLAY=f":{display}", HOME=env.get("HOME") or "/root", XAUTHORITY="/dev/null")
    if os.path.isdir(SHIM_DIR):
        env["PYTHONPATH"] = SHIM_DIR
    return env


def install_shim() -> None:
    """Put ``pyautogui`` on the commands' path when the image's python3 has none."""
    python = shutil.which("python3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    if python and subprocess.run([python, "-c", "import pyautogui"], env=env, capture_output=True).returncode == 0:
        return
    os.makedirs(SHIM_DIR, exist_ok=True)
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyautogui_shim.py")
    shutil.copyfile(src, os.path.join(SHIM_DIR, "pyautogui.py"))


# --- the screen ------------------------------------------------------------------


def xwd_to_png(data: bytes) -> bytes:
    """PNG of an ``xwd -root`` dump of a 24/32-bit TrueColor (or DirectColor) screen."""
    f = struct.unpack_from(">25I", data)
    header_size, width, height, order, bpp, bpl, ncolors = f[0], f[4], f[5], f[7], f[11], f[12], f[19]
    if bpp not in (24, 32) or bpl < 4 * width or f[14:17] != (0xFF0000, 0xFF00, 0xFF):
        raise ValueError(f"screen format not read: {bpp} bits per pixel, masks {f[14:17]}")
    start = header_size + 12 * ncolors
    raw = bytearray()
    for y in range(height):
        row = data[start + y * bpl:start + y * bpl + 4 * width]
        rgb = bytearray(3 * width)
        if order == 0:  # BGRX
            rgb[0::3], rgb[1::3], rgb[2::3] = row[2::4], row[1::4], row[0::4]
        else:  # XRGB
            rgb[0::3], rgb[1::3], rgb[2::3] = row[1::4], row[2::4], row[3::4]
        raw += b"\0" + rgb

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(raw), 1)) + chunk(b"IEND", b"")


def run(argv: list, timeout: float = COMMAND_TIMEOUT, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=desktop_env(), capture_output=True, timeout=timeout, **kw)


def screenshot() -> bytes:
    r = run(["xwd", "-root", "-silent"])
    if r.returncode != 0:
        raise RuntimeError("xwd failed: " + r.stderr.decode(errors="replace"))
    return xwd_to_png(r.stdout)


def screen_size() -> tuple:
    out = run(["xdotool", "getdisplaygeometry"]).stdout.split()
    return int(out[0]), int(out[1])


def windows() -> list:
    """``(id, name, class)`` of the visible windows."""
    ids = run(["xdotool", "search", "--onlyvisible", "--name", ""]).stdout.decode().split()
    out = []
    for wid in ids:
        name = run(["xdotool", "getwindowname", wid]).stdout.decode(errors="replace").strip()
        cls = run(["xprop", "-id", wid, "WM_CLASS"]).stdout.decode(errors="replace")
        if name or "=" in cls:
            out.append((wid, name, cls.partition("=")[2].strip()))
    return out


def find_window(name: str, strict: bool = False, by_class: bool = False):
    for wid, wname, wcls in windows():
        hay = wcls if by_class else wname
        if (hay == name) if strict else (name.lower() in hay.lower()):
            return wid
    return None


# --- commands --------------------------------------------------------------------


def _command(data: dict):
    shell = bool(data.get("shell", False))
    command = data.get("command", "" if shell else [])
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if not shell:
        command = [os.path.expanduser(a) if isinstance(a, str) and a.startswith("~/") else a for a in command]
    return command, shell


def execute(data: dict) -> tuple:
    command, shell = _command(data)
    try:
        r = subprocess.run(command, shell=shell, env=desktop_env(), capture_output=True, text=True,
                           timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return 500, {"status": "error", "message": str(exc)}
    return 200, {"status": "success", "output": r.stdout, "error": r.stderr, "returncode": r.returncode}


def launch(data: dict) -> tuple:
    command, shell = _command(data)
    try:
        subprocess.Popen(command, shell=shell, env=desktop_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    except (OSError, ValueError) as exc:
        return 500, {"status": "error", "message": str(exc)}
    return 200, "{} launched successfully".format(command if shell else " ".join(command))


def open_file(data: dict) -> tuple:
    path = data.get("path")
    if not path:
        return 400, "Path not supplied!"
    path = os.path.expandvars(os.path.expanduser(path))
    timeout = float(data.get("timeout_seconds", 30))
    if os.path.exists(path):
        opener = "dillo" if path.lower().endswith((".html", ".htm")) else (shutil.which("mousepad") and "mousepad"
                                                                          or "xedit")
        argv, titles = [opener, path], [data.get("window_name") or os.path.basename(path)]
    elif shutil.which(path):
        argv, titles = [path], [data.get("window_name") or path]
    else:
        return 404, f"Application/file not found: {path}"
    subprocess.Popen(argv, env=desktop_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for title in titles:
            wid = find_window(title)
            if wid:
                run(["xdotool", "windowactivate", wid])
                return 200, "File opened and window activated successfully"
        time.sleep(0.2)
    return 500, f"Failed to find window for {titles} within {timeout:g} seconds."


def window_action(data: dict, action: str) -> tuple:
    name = data.get("window_name")
    if not name:
        return 400, "window_name required"
    wid = find_window(name, bool(data.get("strict")), bool(data.get("by_class")))
    if wid is None:
        return 404, f"Window {name} not found"
    if action == "activate":
        run(["xdotool", "windowactivate", wid])
        return 200, "Window activated successfully"
    run(["xdotool", "windowclose", wid])
    return 200, "Window closed successfully."


def run_python(data: dict) -> tuple:
    code = data.get("code")
    if not code:
        return 400, {"status": "error", "message": "Code not supplied!"}
    try:
        r = subprocess.run(["python3", "-c", code], env=desktop_env(), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return 500, {"status": "error", "message": "Execution timeout", "error": "TimeoutExpired", "output": None}
    message = r.stdout + (("\n" if r.stdout else "") + r.stderr if r.stderr else "")
    return 200, {"status": "success" if r.returncode == 0 else "error", "message": message, "need_more": False,
                 "output": r.stdout, "error": r.stderr, "return_code": r.returncode}


def run_bash_script(data: dict) -> tuple:
    script = data.get("script")
    if not script:
        return 400, {"status": "error", "output": "Script not supplied!", "error": "", "returncode": -1}
    cwd = os.path.expanduser(data["working_dir"]) if data.get("working_dir") else None
    if cwd and not os.path.isdir(cwd):
        return 400, {"status": "error", "output": "Working directory does not exist: " + cwd, "error": "",
                     "returncode": -1}
    try:
        r = subprocess.run(["bash", "-c", script], env=desktop_env(), cwd=cwd, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=float(data.get("timeout", 100)))
    except subprocess.TimeoutExpired:
        return 500, {"status": "error", "output": "Script execution timed out", "error": "", "returncode": -1}
    return 200, {"status": "success" if r.returncode == 0 else "error", "output": r.stdout, "error": "",
                 "returncode": r.returncode}


def list_directory(data: dict) -> tuple:
    path = data.get("path")
    if not path:
        return 400, {"error": "Missing 'path' parameter"}
    if not os.path.isdir(path):
        return 400, {"error": "The provided path is not a directory"}

    def tree(d: str, depth: int = 0) -> dict:
        children: list = []
        for entry in sorted(os.listdir(d)):
            full = os.path.join(d, entry)
            if os.path.isdir(full) and not os.path.islink(full) and depth < 20:
                children.append(tree(full, depth + 1))
            else:
                children.append({"type": "file", "name": entry})
        return {"type": "directory", "name": os.path.basename(d), "children": children}
    return 200, {"directory_tree": tree(path)}


def download_file(data: dict) -> tuple:
    url, path = data.get("url"), data.get("path")
    if not url or not path:
        return 400, "Path or URL not supplied!"
    path = os.path.expandvars(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=300) as resp, open(path, "wb") as out:
            shutil.copyfileobj(resp, out)
    except (OSError, ValueError) as exc:
        return 500, f"Failed to download {url}. Error: {exc} (a workspace has loopback only unless made with a " \
                    "network)"
    return 200, f"File downloaded successfully: {os.path.getsize(path)} bytes"


UNAVAILABLE = {
    "/accessibility": "the AT-SPI accessibility tree is not available in this workspace (no accessibility bus "
                      "runs on its desktop); use /screenshot",
    "/terminal": "the terminal's text is read through AT-SPI, which is not available in this workspace",
    "/start_recording": "screen recording (ffmpeg) is not available in this workspace",
    "/end_recording": "screen recording (ffmpeg) is not available in this workspace",
    "/setup/change_wallpaper": "this desktop (jwm) has no wallpaper setting",
    "/wallpaper": "this desktop (jwm) has no wallpaper setting",
}


# --- HTTP ------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    server_version = "bunshin-osworld/1"

    def log_message(self, fmt: str, *args) -> None:  # quiet: the workspace's log is not a terminal
        pass

    def _send(self, status: int, body, ctype: str = "") -> None:
        if isinstance(body, (dict, list)):
            raw, ctype = json.dumps(body).encode(), "application/json"
        elif isinstance(body, str):
            raw, ctype = body.encode(), ctype or "text/html; charset=utf-8"
        else:
            raw = body
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/octet-stream")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"request body over {MAX_BODY} bytes")
        return self.rfile.read(n) if n else b""

    def _json(self) -> dict:
        raw = self._body()
        data = json.loads(raw) if raw.strip() else {}
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")
        return data

    def _form(self) -> tuple:
        """(fields, files) of a urlencoded or multipart form."""
        ctype = self.headers.get("Content-Type", "")
        raw = self._body()
        if ctype.startswith("multipart/form-data"):
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
            fields, files = {}, {}
            for part in msg.iter_parts():
                name = str(part.get_param("name", header="content-disposition"))
                payload = part.get_payload(decode=True)
                payload = payload if isinstance(payload, bytes) else b""
                if part.get_filename() is not None:
                    files[name] = payload
                else:
                    fields[name] = payload.decode()
            return fields, files
        return {k: v[0] for k, v in parse_qs(raw.decode()).items()}, {}

    def do_GET(self) -> None:
        try:
            self._get(self.path.split("?", 1)[0])
        except Exception as exc:  # one request's failure is its answer, never the server's end
            self._send(500, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})

    def do_POST(self) -> None:
        try:
            self._post(self.path.split("?", 1)[0])
        except Exception as exc:
            self._send(500, {"status": "error", "message": f"{type(exc).__name__}: {exc}"})

    def _get(self, path: str) -> None:
        if path == "/screenshot":
            self._send(200, screenshot(), "image/png")
        elif path == "/platform":
            self._send(200, "Linux")
        elif path == "/cursor_position":
            out = run(["xdotool", "getmouselocation", "--shell"]).stdout.decode()
            pos = dict(ln.split("=", 1) for ln in out.split() if "=" in ln)
            self._send(200, [int(pos.get("X", 0)), int(pos.get("Y", 0))])
        elif path in UNAVAILABLE:
            self._send(501, {"status": "error", "message": UNAVAILABLE[path]})
        else:
            self._send(404, {"status": "error", "message": "no endpoint GET " + path})

    def _post(self, path: str) -> None:
        json_routes = {
            "/execute": execute, "/setup/execute": execute, "/setup/launch": launch,
            "/setup/open_file": open_file, "/run_python": run_python, "/run_bash_script": run_bash_script,
            "/list_directory": list_directory, "/setup/download_file": download_file,
            "/setup/activate_window": lambda d: window_action(d, "activate"),
            "/setup/close_window": lambda d: window_action(d, "close"),
        }
        if path in json_routes:
            self._send(*json_routes[path](self._json()))
        elif path == "/screen_size":
            w, h = screen_size()
            self._send(200, {"width": w, "height": h})
        elif path == "/desktop_path":
            home = desktop_env()["HOME"]
            desk = os.path.join(home, "Desktop")
            self._send(*((200, {"desktop_path": desk}) if os.path.isdir(desk) else
                         (404, {"error": "Unsupported operating system or desktop path not found"})))
        elif path == "/file":
            fields, _ = self._form()
            fp = fields.get("file_path")
            if not fp:
                self._send(400, {"error": "file_path is required"})
                return
            fp = os.path.expandvars(os.path.expanduser(fp))
            if not os.path.isfile(fp):
                self._send(404, {"error": "File not found"})
                return
            with open(fp, "rb") as f:
                self._send(200, f.read())
        elif path == "/setup/upload":
            fields, files = self._form()
            if "file_path" not in fields or "file_data" not in files:
                self._send(400, {"error": "file_path and file_data are required"})
                return
            fp = os.path.expandvars(os.path.expanduser(fields["file_path"]))
            os.makedirs(os.path.dirname(fp) or ".", exist_ok=True)
            with open(fp, "wb") as f:
                f.write(files["file_data"])
            self._send(200, f"File Uploaded: {os.path.getsize(fp)} bytes")
        elif path == "/window_size":
            fields, _ = self._form()
            wid = find_window(fields.get("app_class_name", ""), by_class=True) if fields.get("app_class_name") else None
            if wid is None:
                self._send(400 if not fields.get("app_class_name") else 404,
                           {"error": "app_class_name is required" if not fields.get("app_class_name")
                            else "no window of that class"})
                return
            geo = dict(ln.split("=", 1) for ln in run(["xdotool", "getwindowgeometry", "--shell", wid])
                       .stdout.decode().split() if "=" in ln)
            self._send(200, {"width": int(geo["WIDTH"]), "height": int(geo["HEIGHT"])})
        elif path in UNAVAILABLE:
            self._send(501, {"status": "error", "message": UNAVAILABLE[path]})
        else:
            self._send(404, {"status": "error", "message": "no endpoint POST " + path})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bunshin_agent.osworld")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args(argv)
    install_shim()
    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
