"""OSWorld's action spaces on a bunshin desktop: ``computer_13`` dicts and ``pyautogui`` code.

``computer_13`` (OSWorld's ``ACTION_SPACE``): ``{"action_type": "CLICK", "parameters":
{"x": 10, "y": 20, "button": "left", "num_clicks": 1}}``, and ``MOVE_TO``, ``MOUSE_DOWN``,
``MOUSE_UP``, ``RIGHT_CLICK``, ``DOUBLE_CLICK``, ``DRAG_TO``, ``SCROLL`` (``dx``/``dy``),
``TYPING`` (``text``), ``PRESS``/``KEY_DOWN``/``KEY_UP`` (``key``), ``HOTKEY`` (``keys``),
and the control actions ``WAIT``, ``FAIL``, ``DONE``. ``pyautogui``: Python code run with
the image's python3 on the desktop (bunshin's stand-in ``pyautogui`` where the image has
none), or the strings ``WAIT``, ``FAIL``, ``DONE``. Coordinates and keys are checked as for
the desktop tools; a bad action raises ``InvalidArgument``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgument
from ..workspace.desktop import PYAUTOGUI_DIR, Desktop
from ..workspace.keys import keysym

CONTROL = ("WAIT", "FAIL", "DONE")
_BUTTONS = {"left": 1, "middle": 2, "right": 3}
WAIT_S = 1.0


def _xy(p: Mapping[str, Any], desk: Desktop) -> tuple[int, int] | None:
    if "x" not in p and "y" not in p:
        return None
    return desk.check_point(p.get("x"), p.get("y"))


def _button(p: Mapping[str, Any]) -> int:
    name = p.get("button", "left")
    if name not in _BUTTONS:
        raise InvalidArgument(f"button {name!r} is not left, middle or right")
    return _BUTTONS[name]


def computer_13(desk: Desktop, action: Mapping[str, Any]) -> str:
    """Do one ``computer_13`` action; returns its type (``DONE``/``FAIL`` end the episode)."""
    kind = action.get("action_type")
    p = action.get("parameters") or {}
    if not isinstance(p, Mapping):
        raise InvalidArgument(f"action {kind}: parameters must be an object")
    if kind in CONTROL:
        if kind == "WAIT":
            time.sleep(WAIT_S)
        return str(kind)
    xy = _xy(p, desk)
    if kind == "MOVE_TO":
        if xy is None:
            raise InvalidArgument("MOVE_TO needs x and y")
        desk.move(*xy)
    elif kind in ("CLICK", "RIGHT_CLICK", "DOUBLE_CLICK"):
        button = 3 if kind == "RIGHT_CLICK" else _button(p)
        count = 2 if kind == "DOUBLE_CLICK" else int(p.get("num_clicks", 1))
        desk.click(*(xy or (None, None)), button=button, count=count)
    elif kind in ("MOUSE_DOWN", "MOUSE_UP"):
        if xy is not None:
            desk.move(*xy)
        desk.xdotool("mousedown" if kind == "MOUSE_DOWN" else "mouseup", str(_button(p)))
    elif kind == "DRAG_TO":
        if xy is None:
            raise InvalidArgument("DRAG_TO needs x and y")
        desk.xdotool("mousedown", "1")
        desk.move(*xy)
        desk.xdotool("mouseup", "1")
    elif kind == "SCROLL":
        dx, dy = int(p.get("dx", 0)), int(p.get("dy", 0))
        if not dx and not dy:
            raise InvalidArgument("SCROLL needs dx or dy")
        if dy:  # OSWorld (as pyautogui): positive is up
            desk.scroll(-dy)
        if dx:
            desk.scroll(dx, horizontal=True)
    elif kind == "TYPING":
        desk.type_text(str(p.get("text", "")))
    elif kind in ("PRESS", "KEY_DOWN", "KEY_UP"):
        sym = keysym(str(p.get("key", "")))
        desk.xdotool({"PRESS": "key", "KEY_DOWN": "keydown", "KEY_UP": "keyup"}[kind], sym)
    elif kind == "HOTKEY":
        keys = p.get("keys")
        if not isinstance(keys, list | tuple) or not keys:
            raise InvalidArgument("HOTKEY needs keys, a list such as ['ctrl', 's']")
        desk.xdotool("key", "+".join(keysym(str(k)) for k in keys))
    else:
        raise InvalidArgument(f"unknown computer_13 action {kind!r}",
                              hint="one of MOVE_TO, CLICK, MOUSE_DOWN, MOUSE_UP, RIGHT_CLICK, DOUBLE_CLICK, "
                                   "DRAG_TO, SCROLL, TYPING, PRESS, KEY_DOWN, KEY_UP, HOTKEY, WAIT, FAIL, DONE")
    return str(kind)


def pyautogui(desk: Desktop, code: str) -> tuple[str, str]:
    """Run OSWorld ``pyautogui`` action code on the desktop; ``(kind, output)``."""
    if code.strip() in CONTROL:
        if code.strip() == "WAIT":
            time.sleep(WAIT_S)
        return code.strip(), ""
    env = {**desk.spec.env}
    has_real = desk.ws.exec(["python3", "-c", "import pyautogui"], env=env).exit_code == 0
    if not has_real:
        env["PYTHONPATH"] = PYAUTOGUI_DIR
        if desk.ws.exec(["test", "-e", f"{PYAUTOGUI_DIR}/pyautogui.py"]).exit_code != 0:
            desk.install_pyautogui()
    r = desk.ws.exec(["python3", "-c", "import pyautogui\n" + code], env=env, timeout=120)
    if r.exit_code != 0:
        raise InvalidArgument(f"the action code failed (exit {r.exit_code}): {r.stderr.strip()[-1500:]}",
                              hint="pyautogui calls with coordinates on the screen")
    return "CODE", r.stdout
