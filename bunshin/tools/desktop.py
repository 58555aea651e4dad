"""The desktop tools: a screenshot in, mouse and keyboard out, on a workspace's desktop.

Shaped like e2b-desktop's SDK and OSWorld's computer_13 actions: ``screenshot`` (a PNG,
an image part of the tool message), ``left_click``, ``right_click``, ``double_click``,
``move_mouse``, ``drag``, ``scroll``, ``type_text``, ``press_key`` (``ctrl+s``),
``wait``, ``launch`` (an app) and ``open`` (a file or URL). Coordinates are checked
against the workspace's screen and keys against :mod:`bunshin.workspace.keys`: a bad
call is the call's error, not an exception. ``screenshot`` is read-only; every other
tool changes the desktop's state (the prefix cache forks after it like after ``bash``).
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import BunshinError, StateConflict
from ..workspace.desktop import Desktop
from ..workspace.protocol import WorkspaceAPI
from .builtin import translate
from .spec import Tool, ToolContext, ToolError, ToolOutput, ToolSpec

#: Seconds an input tool waits for the apps to draw what it did before it returns.
SETTLE_S = 0.15
MAX_WAIT_S = 60.0

_XY = {"x": {"type": "integer", "minimum": 0, "description": "pixels from the left edge"},
       "y": {"type": "integer", "minimum": 0, "description": "pixels from the top edge"}}


def _desktop(ws: WorkspaceAPI) -> Desktop:
    try:
        return Desktop.of(ws)
    except StateConflict as exc:
        raise ToolError(f"{exc.message} ({exc.hint})" if exc.hint else exc.message) from None


def _run(ws: WorkspaceAPI, act: Callable[[Desktop], str], *, settle: bool = True) -> ToolOutput:
    desk = _desktop(ws)
    try:
        out = act(desk)
    except BunshinError as exc:
        raise translate(exc) from None
    if settle:
        time.sleep(SETTLE_S)
    return ToolOutput(out)


def _spec(name: str, description: str, props: Mapping[str, Any], required: tuple[str, ...] = (), *,
          read_only: bool = False, timeout: float = 60.0) -> ToolSpec:
    return ToolSpec(name=name, description=description, read_only=read_only, timeout=timeout,
                    parameters={"type": "object", "properties": dict(props), "required": list(required),
                                "additionalProperties": False})


# --- the executors ----------------------------------------------------------------


def _screenshot(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    desk = _desktop(ws)
    try:
        png = desk.screenshot()
    except BunshinError as exc:
        raise translate(exc) from None
    return ToolOutput(f"screenshot {desk.spec.width}x{desk.spec.height}",
                      images=(base64.b64encode(png).decode("ascii"),))


def _click(button: int, count: int, what: str) -> Callable[[WorkspaceAPI, Mapping[str, Any], ToolContext], ToolOutput]:
    def run(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
        x, y = args["x"], args["y"]

        def act(d: Desktop) -> str:
            d.click(x, y, button=button, count=count)
            return f"{what} at ({x}, {y})"
        return _run(ws, act)
    return run


def _move(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    def act(d: Desktop) -> str:
        d.move(args["x"], args["y"])
        return f"pointer at ({args['x']}, {args['y']})"
    return _run(ws, act)


def _drag(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    a, b = (args["start_x"], args["start_y"]), (args["end_x"], args["end_y"])

    def act(d: Desktop) -> str:
        d.drag(*a, *b)
        return f"dragged from {a} to {b}"
    return _run(ws, act)


_DIRECTIONS = {"down": (1, False), "up": (-1, False), "right": (1, True), "left": (-1, True)}


def _scroll(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    sign, horizontal = _DIRECTIONS[args["direction"]]
    if ("x" in args) != ("y" in args):
        raise ToolError("give both x and y (where to scroll), or neither (where the pointer is)")

    def act(d: Desktop) -> str:
        d.scroll(sign * args["amount"], x=args.get("x"), y=args.get("y"), horizontal=horizontal)
        return f"scrolled {args['direction']} {args['amount']}"
    return _run(ws, act)


def _type(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    def act(d: Desktop) -> str:
        d.type_text(args["text"])
        return f"typed {len(args['text'])} characters"
    return _run(ws, act)


def _press(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    def act(d: Desktop) -> str:
        d.press(args["keys"])
        return f"pressed {args['keys']}"
    return _run(ws, act)


def _wait(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    _desktop(ws)
    time.sleep(float(args["seconds"]))
    return ToolOutput(f"waited {args['seconds']} s")


def _launch(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    def act(d: Desktop) -> str:
        pid = d.launch(args["app"])
        return f"started {args['app']} (pid {pid}); windows: {', '.join(d.windows()) or '(none yet)'}"
    return _run(ws, act)


def _open(ws: WorkspaceAPI, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    def act(d: Desktop) -> str:
        pid = d.open(args["target"])
        return f"opened {args['target']} (pid {pid}); windows: {', '.join(d.windows()) or '(none yet)'}"
    return _run(ws, act)


# --- the tools --------------------------------------------------------------------

SCREENSHOT = Tool(_spec("screenshot", "Take a screenshot of the whole screen (a PNG image).", {},
                        read_only=True, timeout=30.0), _screenshot)
LEFT_CLICK = Tool(_spec("left_click", "Click the left mouse button at (x, y).", _XY, ("x", "y")),
                  _click(1, 1, "left click"))
RIGHT_CLICK = Tool(_spec("right_click", "Click the right mouse button at (x, y).", _XY, ("x", "y")),
                   _click(3, 1, "right click"))
DOUBLE_CLICK = Tool(_spec("double_click", "Double-click the left mouse button at (x, y).", _XY, ("x", "y")),
                    _click(1, 2, "double click"))
MOVE_MOUSE = Tool(_spec("move_mouse", "Move the mouse pointer to (x, y).", _XY, ("x", "y")), _move)
DRAG = Tool(_spec("drag", "Press the left button at (start_x, start_y), move to (end_x, end_y), release.",
                  {"start_x": _XY["x"], "start_y": _XY["y"], "end_x": _XY["x"], "end_y": _XY["y"]},
                  ("start_x", "start_y", "end_x", "end_y")), _drag)
SCROLL = Tool(_spec("scroll", "Scroll the wheel: direction up, down, left or right, amount notches, at (x, y) "
                              "if given.",
                    {"direction": {"type": "string", "enum": list(_DIRECTIONS), "default": "down"},
                     "amount": {"type": "integer", "minimum": 1, "maximum": 50, "default": 3}, **_XY}), _scroll)
TYPE_TEXT = Tool(_spec("type_text", "Type text with the keyboard into the focused window.",
                       {"text": {"type": "string", "minLength": 1, "maxLength": 10000}}, ("text",),
                       timeout=300.0), _type)
PRESS_KEY = Tool(_spec("press_key", "Press a key or a combo, e.g. Return, Escape, Tab, ctrl+s, alt+F4, ctrl+shift+t.",
                       {"keys": {"type": "string", "minLength": 1}}, ("keys",)), _press)
WAIT = Tool(_spec("wait", "Wait a number of seconds (for an app to start or finish drawing).",
                  {"seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WAIT_S, "default": 1}},
                  timeout=MAX_WAIT_S + 10), _wait)
LAUNCH = Tool(_spec("launch", "Start an app on the desktop (a command line, e.g. xterm or 'xedit /root/notes.txt').",
                    {"app": {"type": "string", "minLength": 1}}, ("app",)), _launch)
OPEN = Tool(_spec("open", "Open a file (an absolute path, in the text editor) or a URL (in the browser).",
                  {"target": {"type": "string", "minLength": 1}}, ("target",)), _open)

#: Every desktop tool, in the order a model sees them.
DESKTOP_TOOLS = (SCREENSHOT, LEFT_CLICK, RIGHT_CLICK, DOUBLE_CLICK, MOVE_MOUSE, DRAG, SCROLL, TYPE_TEXT,
                 PRESS_KEY, WAIT, LAUNCH, OPEN)
