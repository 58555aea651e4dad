"""A websocket echo server (ws_echo.py) started inside a sandbox through the e2b SDK, with this
interpreter's ``websockets`` package copied in (same CPython, same machine)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import websockets

ECHO = Path(__file__).with_name("ws_echo.py")


def websockets_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(Path(websockets.__file__).parent, arcname="websockets",
                filter=lambda t: None if "__pycache__" in t.name else t)
    return buf.getvalue()


def start_echo(sbx: Any, port: int) -> Any:
    """The echo server's command handle (``background=True``), listening on ``port`` soon."""
    sbx.files.write("/opt/wslib/ws.tar", websockets_tar())
    sbx.files.write("/opt/ws_echo.py", ECHO.read_text())
    sbx.commands.run("tar -xf /opt/wslib/ws.tar -C /opt/wslib")
    return sbx.commands.run(f"PYTHONPATH=/opt/wslib exec python3 /opt/ws_echo.py {port}", background=True)
