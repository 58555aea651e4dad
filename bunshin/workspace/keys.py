"""Key names a desktop accepts, mapped to X keysyms for xdotool.

A key is a combo of names joined by ``+`` (``ctrl+s``, ``ctrl+shift+Tab``, ``Return``).
Names are the X keysyms people use and the aliases of pyautogui/OSWorld and e2b
(``enter``, ``esc``, ``pageup``, ``cmd``, ``win``), case-insensitive, plus any one
printable ASCII character. Anything else is refused, so a typo is an error the caller
sees rather than a key xdotool silently drops.
"""

from __future__ import annotations

from ..errors import InvalidArgument

_ALIASES = {
    "ctrl": "ctrl", "control": "ctrl", "ctrlleft": "Control_L", "ctrlright": "Control_R",
    "alt": "alt", "altleft": "Alt_L", "altright": "Alt_R", "option": "alt",
    "shift": "shift", "shiftleft": "Shift_L", "shiftright": "Shift_R",
    "super": "super", "win": "super", "winleft": "Super_L", "winright": "Super_R", "cmd": "super",
    "command": "super", "meta": "meta",
    "enter": "Return", "return": "Return", "kp_enter": "KP_Enter",
    "tab": "Tab", "esc": "Escape", "escape": "Escape", "space": "space", "backspace": "BackSpace",
    "delete": "Delete", "del": "Delete", "insert": "Insert", "home": "Home", "end": "End",
    "pageup": "Page_Up", "page_up": "Page_Up", "pgup": "Page_Up", "prior": "Prior",
    "pagedown": "Page_Down", "page_down": "Page_Down", "pgdn": "Page_Down", "next": "Next",
    "up": "Up", "down": "Down", "left": "Left", "right": "Right",
    "capslock": "Caps_Lock", "caps_lock": "Caps_Lock", "numlock": "Num_Lock", "num_lock": "Num_Lock",
    "printscreen": "Print", "print": "Print", "prtsc": "Print", "pause": "Pause", "menu": "Menu",
    "apps": "Menu", "scrolllock": "Scroll_Lock",
    "volumeup": "XF86AudioRaiseVolume", "volumedown": "XF86AudioLowerVolume", "volumemute": "XF86AudioMute",
}
_FUNCTION = {f"f{i}": f"F{i}" for i in range(1, 25)}
_PUNCT = {
    "+": "plus", "-": "minus", "=": "equal", ",": "comma", ".": "period", "/": "slash",
    "\\": "backslash", ";": "semicolon", "'": "apostrophe", "`": "grave", "[": "bracketleft",
    "]": "bracketright", "!": "exclam", "@": "at", "#": "numbersign", "$": "dollar", "%": "percent",
    "^": "asciicircum", "&": "ampersand", "*": "asterisk", "(": "parenleft", ")": "parenright",
    "_": "underscore", "{": "braceleft", "}": "braceright", "|": "bar", ":": "colon", '"': "quotedbl",
    "<": "less", ">": "greater", "?": "question", "~": "asciitilde", " ": "space",
}
#: Every name ``keysym`` accepts besides single characters (for the tools' descriptions).
NAMES = tuple(sorted(set(_ALIASES) | set(_FUNCTION)))


def keysym(name: str) -> str:
    """The xdotool keysym of one key name; ``InvalidArgument`` for an unknown one."""
    if len(name) == 1 and name.isascii() and name.isprintable():
        return _PUNCT.get(name, name)
    low = name.lower()
    if low in _ALIASES:
        return _ALIASES[low]
    if low in _FUNCTION:
        return _FUNCTION[low]
    raise InvalidArgument(f"unknown key {name!r}",
                          hint="use a key name such as Return, Escape, Tab, BackSpace, Up, F5, ctrl, alt, "
                               "shift, super, or one character; join a combo with '+' (ctrl+s)")


def xdotool_combo(keys: str) -> str:
    """``ctrl+shift+t`` as xdotool's ``ctrl+shift+t``, every part checked."""
    if not isinstance(keys, str) or not keys.strip():
        raise InvalidArgument("no key given", hint="e.g. Return or ctrl+s")
    if keys == "+":
        return keysym("+")
    parts = keys.split("+")
    if keys.endswith("++"):  # "ctrl++": the plus key itself
        parts = [*keys[:-2].split("+"), "+"]
    if any(p == "" for p in parts):
        raise InvalidArgument(f"key combo {keys!r} has an empty part", hint="join keys with one '+': ctrl+s")
    return "+".join(keysym(p.strip() if len(p) > 1 else p) for p in parts)
