"""A small ``pyautogui`` for a desktop workspace whose image has none (stdlib only).

OSWorld's ``pyautogui`` action space sends Python code that imports ``pyautogui`` and
calls its mouse and keyboard functions; the OSWorld server (``osworld``) puts this file
on those commands' path as ``pyautogui.py`` when the image lacks the real package. The
calls drive xdotool on ``$DISPLAY``. Covered: ``click``, ``doubleClick``, ``tripleClick``,
``rightClick``, ``middleClick``, ``moveTo``, ``moveRel``/``move``, ``dragTo``, ``dragRel``,
``mouseDown``, ``mouseUp``, ``scroll`` (positive is up, as in pyautogui), ``hscroll``,
``write``/``typewrite``, ``press``, ``hotkey``, ``keyDown``, ``keyUp``, ``position``,
``size``, ``sleep``. Anything else raises ``NotImplementedError`` naming it.
"""

import subprocess
import time

FAILSAFE = False
PAUSE = 0.0

_BUTTONS = {"left": "1", "middle": "2", "right": "3", 1: "1", 2: "2", 3: "3"}
_KEYS = {
    "enter": "Return", "return": "Return", "esc": "Escape", "escape": "Escape", "tab": "Tab", "space": "space",
    "backspace": "BackSpace", "delete": "Delete", "del": "Delete", "insert": "Insert", "home": "Home",
    "end": "End", "pageup": "Page_Up", "pgup": "Page_Up", "pagedown": "Page_Down", "pgdn": "Page_Down",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right", "ctrl": "ctrl", "ctrlleft": "Control_L",
    "ctrlright": "Control_R", "control": "ctrl", "alt": "alt", "altleft": "Alt_L", "altright": "Alt_R",
    "shift": "shift", "shiftleft": "Shift_L", "shiftright": "Shift_R", "win": "super", "winleft": "Super_L",
    "winright": "Super_R", "command": "super", "cmd": "super", "option": "alt", "capslock": "Caps_Lock",
    "numlock": "Num_Lock", "printscreen": "Print", "prntscrn": "Print", "pause": "Pause", "menu": "Menu",
    "+": "plus", "-": "minus", "=": "equal", ",": "comma", ".": "period", "/": "slash", "\\": "backslash",
    ";": "semicolon", "'": "apostrophe", "`": "grave", "[": "bracketleft", "]": "bracketright", " ": "space",
}
_KEYS.update({f"f{i}": f"F{i}" for i in range(1, 25)})


def _xdotool(*args) -> str:
    r = subprocess.run(["xdotool", *[str(a) for a in args]], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("xdotool {}: {}".format(" ".join(map(str, args)), r.stderr.strip()))
    time.sleep(PAUSE)
    return r.stdout


def _key(name) -> str:
    name = str(name)
    if len(name) == 1 and name not in _KEYS:
        return name
    if name.lower() in _KEYS:
        return _KEYS[name.lower()]
    raise ValueError(f"unknown key {name!r}")


def position():
    out = dict(ln.split("=", 1) for ln in _xdotool("getmouselocation", "--shell").split() if "=" in ln)
    return int(out["X"]), int(out["Y"])


def size():
    w, h = _xdotool("getdisplaygeometry").split()
    return int(w), int(h)


def moveTo(x=None, y=None, duration=0.0, *args, **kw):
    cx, cy = position()
    _xdotool("mousemove", "--sync", int(cx if x is None else x), int(cy if y is None else y))


def moveRel(xOffset=0, yOffset=0, duration=0.0, *args, **kw):
    cx, cy = position()
    moveTo(cx + int(xOffset), cy + int(yOffset))


move = moveRel


def click(x=None, y=None, clicks=1, interval=0.0, button="left", *args, **kw):
    if x is not None or y is not None:
        moveTo(x, y)
    _xdotool("click", "--repeat", int(clicks), "--delay", int(max(interval, 0.08) * 1000), _BUTTONS[button])


def doubleClick(x=None, y=None, interval=0.0, button="left", *args, **kw):
    click(x, y, 2, interval, button)


def tripleClick(x=None, y=None, interval=0.0, button="left", *args, **kw):
    click(x, y, 3, interval, button)


def rightClick(x=None, y=None, *args, **kw):
    click(x, y, 1, 0.0, "right")


def middleClick(x=None, y=None, *args, **kw):
    click(x, y, 1, 0.0, "middle")


def mouseDown(x=None, y=None, button="left", *args, **kw):
    if x is not None or y is not None:
        moveTo(x, y)
    _xdotool("mousedown", _BUTTONS[button])


def mouseUp(x=None, y=None, button="left", *args, **kw):
    if x is not None or y is not None:
        moveTo(x, y)
    _xdotool("mouseup", _BUTTONS[button])


def dragTo(x=None, y=None, duration=0.0, button="left", *args, **kw):
    mouseDown(button=button)
    moveTo(x, y)
    mouseUp(button=button)


def dragRel(xOffset=0, yOffset=0, duration=0.0, button="left", *args, **kw):
    cx, cy = position()
    dragTo(cx + int(xOffset), cy + int(yOffset), button=button)


def scroll(clicks, x=None, y=None, *args, **kw):
    if x is not None or y is not None:
        moveTo(x, y)
    clicks = int(clicks)
    if clicks:
        _xdotool("click", "--repeat", abs(clicks), "--delay", 20, "4" if clicks > 0 else "5")


vscroll = scroll


def hscroll(clicks, x=None, y=None, *args, **kw):
    if x is not None or y is not None:
        moveTo(x, y)
    clicks = int(clicks)
    if clicks:
        _xdotool("click", "--repeat", abs(clicks), "--delay", 20, "7" if clicks > 0 else "6")


def write(message, interval=0.0, *args, **kw):
    if isinstance(message, (list, tuple)):
        for k in message:
            press(k)
        return
    _xdotool("type", "--delay", int(max(interval, 0.012) * 1000), "--", str(message))


typewrite = write


def press(keys, presses=1, interval=0.0, *args, **kw):
    for _ in range(int(presses)):
        for k in (keys if isinstance(keys, (list, tuple)) else [keys]):
            _xdotool("key", _key(k))
            time.sleep(interval)


def hotkey(*keys, **kw):
    _xdotool("key", "+".join(_key(k) for k in keys))


def keyDown(key, *args, **kw):
    _xdotool("keydown", _key(key))


def keyUp(key, *args, **kw):
    _xdotool("keyup", _key(key))


def sleep(seconds):
    time.sleep(seconds)


def __getattr__(name):
    raise NotImplementedError(f"pyautogui.{name} is not provided by bunshin's stand-in (no pyautogui in this image)"
                              )
