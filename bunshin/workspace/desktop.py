"""A desktop inside a workspace: Xvfb, a window manager, optional x11vnc, and input.

Everything runs inside the workspace, started through the workspace protocol (so a
local, remote or forked workspace all work the same): ``Xvfb :N`` (no TCP listener;
its unix socket is in the workspace's own /tmp and its abstract socket in the
workspace's own network namespace), then the window manager, then optionally
``x11vnc -localhost`` (loopback of the workspace's network namespace only). The spec
is written to ``/tmp/.bunshin-desktop/desktop.json`` inside, so a clone, a later
CLI call or a tool finds the desktop it inherited (:meth:`Desktop.of`).

Facts (Debian 12, CRIU 4.2, measured here): Xvfb, jwm, xterm, xeyes, xmessage,
xedit (Xaw), Tk (wish), dillo (FLTK), Firefox ESR, Chromium (``--no-sandbox``, as
root requires) and, since inotify watches on the workspace's overlay fork, the GTK apps
mousepad and gnumeric dump and restore with their windows, documents and pixels. The window manager is jwm: openbox works too but, inside a
workspace, manages no window in its first ~10 s after it starts (measured; cause not found).
GTK's cursor blink is turned off (``GTK_SETTINGS``) so a still screen stays still.
Screenshots are ``xwd -root`` read into PNG on the caller's side; input is xdotool.
"""

from __future__ import annotations

import json
import re
import shlex
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, RuntimeFailure, StateConflict
from ..runtime.agent_host.bundle import AgentBundle
from ..runtime.kernel.limits import MAX_OUTPUT
from . import xwd
from .keys import xdotool_combo
from .protocol import WorkspaceAPI

#: Inside the workspace: the desktop's spec and its programs' logs.
STATE_DIR = "/tmp/.bunshin-desktop"
STATE_FILE = f"{STATE_DIR}/desktop.json"
GTK_SETTINGS = "/root/.config/gtk-3.0/settings.ini"
#: What ``start`` needs inside the workspace (Debian: xvfb, x11-apps, x11-utils, xdotool).
REQUIRED = ("Xvfb", "xwd", "xdotool", "xdpyinfo")
WINDOW_MANAGERS = ("jwm", "openbox", "none")
#: Largest XWD a screenshot reads (8192x8192 at 32 bits per pixel, plus the header).
_MAX_XWD = 8192 * 8192 * 4 + 65536
#: jwm's settings: click to focus, one desktop, no tray (its clock would change the screen
#: every minute, so no two screenshots a minute apart could be equal) and no root menu.
JWMRC = """<?xml version="1.0"?>
<JWM>
  <FocusModel>click</FocusModel>
  <Desktops width="1" height="1"/>
  <WindowStyle>
    <Font>Sans-10</Font>
    <Foreground>black</Foreground><Background>#c0c0c0</Background>
    <Active><Foreground>white</Foreground><Background>#3465a4</Background></Active>
  </WindowStyle>
</JWM>
"""
#: Where ``install_pyautogui`` puts the stand-in (the OSWorld server uses the same folder).
PYAUTOGUI_DIR = f"{STATE_DIR}/pyautogui"
#: OSWorld's VM server port (its controllers' default).
OSWORLD_PORT = 5000
_PORT_PROBE = ("import socket,sys; s=socket.socket(); s.settimeout(1); "
               "sys.exit(s.connect_ex(('127.0.0.1', {port})))")
_URL = re.compile(r"^(https?|file)://", re.IGNORECASE)


@dataclass(frozen=True)
class DesktopSpec:
    """The desktop of a workspace: screen size and depth, display number, window manager,
    and the apps ``open`` uses (``browser`` for URLs and .html, ``editor`` for the rest)."""

    width: int = 1280
    height: int = 800
    depth: int = 24
    display: int = 0
    window_manager: str = "jwm"
    vnc: bool = False
    vnc_port: int = 5900
    browser: str = "dillo"
    editor: str = "xedit"

    def __post_init__(self) -> None:
        for name, lo, hi in (("width", 64, 8192), ("height", 64, 8192), ("display", 0, 999),
                             ("vnc_port", 1024, 65535)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise InvalidArgument(f"desktop {name} {v!r} is not an integer in {lo}..{hi}",
                                      hint="e.g. DesktopSpec(width=1280, height=800)")
        if self.depth not in (16, 24):
            raise InvalidArgument(f"desktop depth {self.depth!r} is not 16 or 24", hint="use 24 (the default)")
        if self.window_manager not in WINDOW_MANAGERS:
            raise InvalidArgument(f"window manager {self.window_manager!r} is not one of {WINDOW_MANAGERS}",
                                  hint="jwm (the default), openbox, or none")
        for name in ("browser", "editor"):
            if not re.fullmatch(r"[A-Za-z0-9_.+-]+", getattr(self, name)):
                raise InvalidArgument(f"desktop {name} {getattr(self, name)!r} is not a program name",
                                      hint="a command on the workspace's PATH, e.g. dillo or xedit")

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @property
    def env(self) -> dict[str, str]:
        """What every program on this desktop runs with."""
        return {"DISPLAY": f":{self.display}", "HOME": "/root", "XAUTHORITY": "/dev/null"}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DesktopSpec:
        known = set(cls.__dataclass_fields__)
        extra = set(data) - known
        if extra:
            raise InvalidArgument(f"unknown desktop settings {sorted(extra)}", hint=f"known: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def parse(cls, value: DesktopSpec | bool | str | Mapping[str, Any] | None) -> DesktopSpec | None:
        """``True`` (the default desktop), ``"1280x800"`` or ``"1280x800x24"``, a mapping of
        fields, a spec; ``None``/``False``: no desktop."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, DesktopSpec):
            return value
        if isinstance(value, str):
            m = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?", value.strip())
            if not m:
                raise InvalidArgument(f"desktop screen {value!r} is not WIDTHxHEIGHT[xDEPTH]",
                                      hint="e.g. 1280x800 or 1280x800x24")
            return cls(width=int(m[1]), height=int(m[2]), depth=int(m[3] or 24))
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise InvalidArgument(f"desktop {value!r}: expected true, WIDTHxHEIGHT[xDEPTH] or a mapping")


def forward_command(host_pid: int, inner_port: int, port: int) -> list[str]:
    """The host command that serves a workspace's loopback ``inner_port`` on the host's
    127.0.0.1:``port``: socat listening on the host, each connection joined to a socat in
    the workspace's network namespace only (``host_pid``: the workspace's init, as the host
    sees it; no path or socket of the workspace is used)."""
    inner = f"nsenter --net=/proc/{host_pid}/ns/net socat STDIO TCP\\:127.0.0.1\\:{inner_port}"  # socat: \\: is a colon
    return ["socat", f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork", f"EXEC:{inner}"]


class Desktop:
    """The desktop running in one workspace: screenshots, input, launching apps.

    Get one with :meth:`start` (a new desktop) or :meth:`of` (the one a workspace, or
    the workspace it was forked from, started). Input methods check coordinates
    against the screen and keys against :mod:`bunshin.workspace.keys` and raise
    ``InvalidArgument`` before anything reaches the workspace.
    """

    def __init__(self, ws: WorkspaceAPI, spec: DesktopSpec) -> None:
        self.ws = ws
        self.spec = spec

    # --- life -----------------------------------------------------------------------

    @classmethod
    def start(cls, ws: WorkspaceAPI, spec: DesktopSpec | None = None, *, timeout: float = 20.0) -> Desktop:
        """Start Xvfb, the window manager and (``spec.vnc``) x11vnc in ``ws``; return when
        the X server answers and the window manager holds the screen."""
        spec = spec or DesktopSpec()
        desk = cls(ws, spec)
        desk._check_programs()
        if ws.exec(["test", "-e", STATE_FILE]).exit_code == 0:
            raise StateConflict(f"workspace {ws.id} already has a desktop",
                                hint="use Desktop.of(ws); one desktop per workspace")
        ws.exec(["mkdir", "-p", STATE_DIR])
        # GTK's text cursor blinks (two screenshots a second apart would differ): off, unless
        # the image brings its own GTK settings
        ws.exec(["sh", "-c", f"test -e {GTK_SETTINGS} || {{ mkdir -p {GTK_SETTINGS.rsplit('/', 1)[0]} && "
                             f"printf '[Settings]\\ngtk-cursor-blink=false\\n' > {GTK_SETTINGS}; }}"])
        d = spec.display
        desk._daemon("xvfb", ["Xvfb", f":{d}", "-screen", "0", f"{spec.width}x{spec.height}x{spec.depth}",
                              "-nolisten", "tcp", "-noreset"])
        desk._wait(["xdpyinfo"], timeout, "the X server (Xvfb)", "xvfb")
        if spec.window_manager == "jwm":
            ws.files.write(f"{STATE_DIR}/jwmrc", JWMRC)
            desk._daemon("wm", ["jwm", "-f", f"{STATE_DIR}/jwmrc"])
        elif spec.window_manager == "openbox":
            desk._daemon("wm", ["openbox"])
        if spec.window_manager != "none":
            desk._wait(["sh", "-c", "xprop -root _NET_SUPPORTING_WM_CHECK | grep -q 'window id'"],
                       timeout, f"the window manager ({spec.window_manager})", "wm")
        if spec.vnc:
            desk.start_vnc(timeout=timeout)
        ws.files.write(STATE_FILE, json.dumps(spec.to_dict()))
        return desk

    @classmethod
    def of(cls, ws: WorkspaceAPI) -> Desktop:
        """The desktop ``ws`` runs (started in it or in the workspace it was forked from)."""
        r = ws.exec(["cat", STATE_FILE])
        if r.exit_code != 0:
            raise StateConflict(f"workspace {ws.id} has no desktop",
                                hint="create it with `bunshin create --desktop` or Workspace.create(desktop=True)")
        try:
            data = json.loads(r.stdout)
        except ValueError:
            raise StateConflict(f"workspace {ws.id}: {STATE_FILE} is not JSON",
                                hint="something in the workspace overwrote it; create a new desktop workspace") from None
        if not isinstance(data, dict):
            raise StateConflict(f"workspace {ws.id}: {STATE_FILE} is not a JSON object",
                                hint="create a new desktop workspace")
        return cls(ws, DesktopSpec.from_dict(data))

    def start_osworld(self, port: int = OSWORLD_PORT, *, timeout: float = 20.0) -> int:
        """Start OSWorld's VM server contract (``bunshin_agent.osworld``) on the workspace's
        loopback ``port``, under the agent's own Python (any image); its pid."""
        bundle = AgentBundle(Path("/"))
        python = bundle.argv[:4]
        pid = self.ws.commands.spawn(["sh", "-c", " ".join(shlex.quote(a) for a in [
            *python, "-s", "-B", "-m", "bunshin_agent.osworld", "--port", str(port)]) +
            f" >{STATE_DIR}/osworld.log 2>&1 </dev/null"], env={**bundle.env, **self.spec.env})
        self._wait([*python, "-c", _PORT_PROBE.format(port=port)], timeout, "the OSWorld server", "osworld",
                   env=bundle.env)
        return pid

    def install_pyautogui(self) -> None:
        """Put bunshin's stand-in ``pyautogui`` (xdotool underneath) at ``PYAUTOGUI_DIR``, for
        action code where the image has no pyautogui (``PYTHONPATH=PYAUTOGUI_DIR``)."""
        r = self.ws.exec(["sh", "-c", f"mkdir -p {PYAUTOGUI_DIR} && cp {AgentBundle.PACKAGE_DIR}/pyautogui_shim.py "
                                      f"{PYAUTOGUI_DIR}/pyautogui.py"])
        if r.exit_code != 0:
            raise RuntimeFailure(f"could not install the stand-in pyautogui: {r.stderr.strip()}",
                                 hint="is /tmp writable in the workspace?")

    def start_vnc(self, *, timeout: float = 20.0) -> int:
        """Start x11vnc on the workspace's loopback (``spec.vnc_port``), view-only (a person
        watches; input is the agent's); its pid."""
        self._require("x11vnc", "x11vnc")
        pid = self._daemon("vnc", ["x11vnc", "-display", f":{self.spec.display}", "-localhost", "-rfbport",
                                   str(self.spec.vnc_port), "-forever", "-shared", "-nopw", "-viewonly", "-quiet"])
        bundle = AgentBundle(Path("/"))
        self._wait([*bundle.argv[:4], "-c", _PORT_PROBE.format(port=self.spec.vnc_port)], timeout, "x11vnc", "vnc",
                   env=bundle.env)
        return pid

    def _check_programs(self) -> None:
        missing = self.ws.exec(["sh", "-c", 'for p in "$@"; do command -v "$p" >/dev/null || echo "$p"; done',
                                "sh", *REQUIRED, *([self.spec.window_manager] if self.spec.window_manager != "none"
                                                   else [])]).stdout.split()
        if missing:
            raise StateConflict(f"the workspace's image lacks {', '.join(missing)}",
                                hint="on the host run `make install` (it installs xvfb, x11-apps, x11-utils, "
                                     "xdotool, jwm); an OCI image must install them itself")

    def _require(self, program: str, package: str) -> None:
        if self.ws.exec(["sh", "-c", f"command -v {shlex.quote(program)}"]).exit_code != 0:
            raise StateConflict(f"the workspace's image lacks {program}",
                                hint=f"install the Debian package {package} (on the host: `make install`)")

    def _daemon(self, name: str, argv: Sequence[str]) -> int:
        log = f"{STATE_DIR}/{name}.log"
        line = " ".join(shlex.quote(a) for a in argv)
        return self.ws.commands.spawn(["sh", "-c", f"exec {line} >{log} 2>&1 </dev/null"], env=self.spec.env)

    def _wait(self, probe: Sequence[str], timeout: float, what: str, log: str,
              env: Mapping[str, str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.ws.exec(list(probe), env=dict(env or self.spec.env), timeout=10).exit_code == 0:
                return
            if time.monotonic() > deadline:
                tail = self.ws.exec(["tail", "-c", "2000", f"{STATE_DIR}/{log}.log"]).stdout
                raise RuntimeFailure(f"{what} did not start in {timeout:g} s in workspace {self.ws.id}",
                                     hint=f"its log says: {tail.strip() or '(nothing)'}")
            time.sleep(0.05)

    # --- observation ----------------------------------------------------------------

    def screenshot_xwd(self) -> bytes:
        """The screen as XWD: the command's output when it fits ``MAX_OUTPUT`` (screens up to
        about 2048x2048), else through a file in the workspace's /tmp."""
        most = self.spec.width * self.spec.height * 4 + 65536  # 32 bits a pixel at 24 bits deep, the header
        out = None if most <= MAX_OUTPUT else f"/tmp/.bunshin-shot-{uuid.uuid4().hex}.xwd"
        argv = ["xwd", "-root", "-silent", *(["-out", out] if out else [])]
        r = self.ws.commands.run(argv, env=self.spec.env, timeout=30, max_output=None if out else most, text=False)
        if r.exit_code != 0:
            raise RuntimeFailure(f"xwd failed in workspace {self.ws.id}: {r.stderr.decode(errors='replace')[:500]}",
                                 hint="is the desktop still running? `bunshin exec WS -- ps ax`")
        if out is None:
            return r.stdout
        try:
            return self.ws.files.read(out, length=min(most, _MAX_XWD))
        finally:
            self.ws.files.remove(out)

    def screenshot(self) -> bytes:
        """The whole screen as PNG bytes."""
        return xwd.to_png(self.screenshot_xwd())

    def windows(self) -> list[str]:
        """The names of the app windows on the screen (top-level, mapped), oldest first."""
        names = []
        for wid in self._visible():
            name = self.xdotool("getwindowname", wid, check=False).strip()
            if name:
                names.append(name)
        return names

    # --- input ----------------------------------------------------------------------

    def check_point(self, x: Any, y: Any) -> tuple[int, int]:
        """``(x, y)`` as ints on the screen, or ``InvalidArgument``."""
        w, h = self.spec.size
        for name, v, hi in (("x", x, w), ("y", y, h)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v != int(v):
                raise InvalidArgument(f"{name} {v!r} is not an integer pixel coordinate")
            if not 0 <= int(v) < hi:
                raise InvalidArgument(f"({x}, {y}) is off the {w}x{h} screen",
                                      hint=f"x in 0..{w - 1}, y in 0..{h - 1}")
        return int(x), int(y)

    def xdotool(self, *args: str, check: bool = True) -> str:
        r = self.ws.exec(["xdotool", *args], env=self.spec.env, timeout=30)
        if check and r.exit_code != 0:
            raise RuntimeFailure(f"xdotool {' '.join(args)} failed: {r.stderr.strip()[:300]}",
                                 hint="is the desktop still running?")
        return r.stdout

    def move(self, x: int, y: int) -> None:
        x, y = self.check_point(x, y)
        self.xdotool("mousemove", "--sync", str(x), str(y))

    def click(self, x: int | None = None, y: int | None = None, *, button: int = 1, count: int = 1) -> None:
        """Click ``button`` (1 left, 2 middle, 3 right) ``count`` times at ``(x, y)`` (or where
        the pointer is)."""
        if button not in (1, 2, 3):
            raise InvalidArgument(f"button {button!r} is not 1 (left), 2 (middle) or 3 (right)")
        if count not in (1, 2, 3):
            raise InvalidArgument(f"click count {count!r} is not 1, 2 or 3")
        if x is not None or y is not None:
            self.move(x, y)  # type: ignore[arg-type]
        self.xdotool("click", "--repeat", str(count), "--delay", "80", str(button))

    def drag(self, x1: int, y1: int, x2: int, y2: int, *, button: int = 1) -> None:
        a, b = self.check_point(x1, y1), self.check_point(x2, y2)
        self.xdotool("mousemove", "--sync", str(a[0]), str(a[1]), "mousedown", str(button),
                     "mousemove", "--sync", str(b[0]), str(b[1]), "mouseup", str(button))

    def scroll(self, amount: int, *, x: int | None = None, y: int | None = None, horizontal: bool = False) -> None:
        """Scroll ``amount`` notches: positive down (or right), negative up (or left)."""
        if isinstance(amount, bool) or not isinstance(amount, int) or not -50 <= amount <= 50 or amount == 0:
            raise InvalidArgument(f"scroll amount {amount!r} is not a non-zero integer in -50..50")
        if x is not None or y is not None:
            self.move(x, y)  # type: ignore[arg-type]
        button = (7 if amount > 0 else 6) if horizontal else (5 if amount > 0 else 4)
        self.xdotool("click", "--repeat", str(abs(amount)), "--delay", "20", str(button))

    def type_text(self, text: str) -> None:
        if not isinstance(text, str) or not text:
            raise InvalidArgument("text to type is empty")
        if len(text) > 10000:
            raise InvalidArgument(f"text of {len(text)} characters is too long to type", hint="at most 10000")
        self.xdotool("type", "--delay", "12", "--", text)

    def press(self, keys: str) -> None:
        """Press a key or a combo (``ctrl+s``, ``Return``, ``alt+F4``)."""
        self.xdotool("key", "--delay", "20", xdotool_combo(keys))

    # --- apps -----------------------------------------------------------------------

    def launch(self, command: str | Sequence[str], *, wait: float = 10.0) -> int:
        """Start an app on the desktop; returns its pid once a new window shows (or after
        ``wait`` seconds)."""
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        if not argv:
            raise InvalidArgument("no app to launch")
        if self.ws.exec(["sh", "-c", 'command -v "$1"', "sh", argv[0]]).exit_code != 0:
            raise InvalidArgument(f"no program {argv[0]!r} in the workspace",
                                  hint="install its Debian package, or give a path to it")
        before = set(self._visible())
        pid = self.ws.commands.spawn(argv, env=self.spec.env, cwd="/root")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if set(self._visible()) - before:
                time.sleep(0.3)  # its first paint
                break
            time.sleep(0.1)
        return pid

    def open(self, target: str) -> int:
        """Open a URL (or an .html file) in ``spec.browser``, any other path in ``spec.editor``."""
        if not isinstance(target, str) or not target.strip():
            raise InvalidArgument("nothing to open", hint="a path inside the workspace or an http(s) URL")
        is_url = bool(_URL.match(target))
        if not is_url and not target.startswith("/"):
            raise InvalidArgument(f"{target!r} is neither an absolute path nor an http(s)/file URL")
        if not is_url and self.ws.exec(["test", "-e", target]).exit_code != 0:
            raise InvalidArgument(f"{target}: no such file in the workspace")
        app = self.spec.browser if is_url or target.lower().endswith((".html", ".htm")) else self.spec.editor
        return self.launch([app, target])

    def _visible(self) -> list[str]:
        """Ids of the app windows: the window manager's client list, or (without one) the
        root's mapped children."""
        if self.spec.window_manager != "none":
            out = self.ws.exec(["xprop", "-root", "_NET_CLIENT_LIST"], env=self.spec.env, timeout=10).stdout
            return re.findall(r"0x[0-9a-f]+", out.partition("#")[2])
        out = self.ws.exec(["xwininfo", "-root", "-children"], env=self.spec.env, timeout=10).stdout
        return [m[1] for m in re.finditer(r"^\s+(0x[0-9a-f]+) (?!\(has no name\))", out, re.MULTILINE)]
