"""Shells on ptys: picking the shell, opening the pty, and ``attach``.

``attach`` gives a human (``bunshin sh``) a fresh interactive shell: after the
agent's ``ok`` the connection is a raw byte pipe to the pty, both ways, until
either side closes. Terminal handling (raw mode, resizes) is the client's job;
the pty size is set once from the request.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import socket
import struct
import termios
from typing import Any

from . import procfs
from .children import Child, Reaper, child_env, default_cwd
from .protocol import arg_env, arg_int, arg_path, arg_str, invalid

ROWS, COLS = 40, 160


def pick_shell(kind: str | None, interactive_rc: bool) -> tuple[str, list[str]]:
    if kind not in (None, "bash", "sh"):
        raise invalid(f"unknown session kind {kind!r} (expected 'bash' or 'sh')")
    if kind != "sh" and os.access("/bin/bash", os.X_OK):
        flags = [] if interactive_rc else ["--noediting", "--norc", "--noprofile"]
        return "bash", ["/bin/bash", *flags, "-i"]
    # +m: no job control. busybox's ash opens /dev/tty for it, a second handle on the
    # controlling terminal that CRIU refuses to dump ("ctty inheritance detected"):
    # with it a workspace whose only shell is busybox's could not be forked.
    # Background jobs (``&``, ``jobs``, ``kill %1``) still work.
    return "sh", ["/bin/sh", "+m", "-i"]


def open_pty(*, echo: bool, rows: int = ROWS, cols: int = COLS) -> tuple[int, int]:
    master, slave = os.openpty()
    os.set_inheritable(master, False)
    attrs = termios.tcgetattr(slave)
    if not echo:
        attrs[1] &= ~termios.ONLCR
        attrs[3] &= ~(termios.ECHO | termios.ECHONL)
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    return master, slave


def start_shell(
    reaper: Reaper,
    argv: list[str],
    req: dict[str, Any],
    *,
    echo: bool,
    rows: int = ROWS,
    cols: int = COLS,
    extra_env: dict[str, str] | None = None,
) -> tuple[Child, int]:
    env = child_env({**(extra_env or {}), **arg_env(req)})
    cwd = arg_path(req, "cwd", None) or default_cwd(env)
    master, slave = open_pty(echo=echo, rows=rows, cols=cols)
    try:
        child = reaper.start(
            argv, env=env, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, controlling_tty=True
        )
    except BaseException:
        os.close(master)
        raise
    finally:
        os.close(slave)
    return child, master


class Attachment:
    """A human's shell on a fresh pty, bridged byte for byte to a connection."""

    def __init__(self, reaper: Reaper, req: dict[str, Any]) -> None:
        rows = arg_int(req, "rows", 24, minimum=1)
        cols = arg_int(req, "cols", 80, minimum=1)
        _, argv = pick_shell(arg_str(req, "kind", None), interactive_rc=True)
        self.child, self.master = start_shell(reaper, argv, req, echo=True, rows=rows, cols=cols)

    def bridge(self, conn: socket.socket, pending: bytes) -> None:
        """Copy both ways until either side closes; then end the shell's session."""
        sel = selectors.DefaultSelector()
        try:
            if pending:
                self._to_pty(pending)
            sel.register(conn, selectors.EVENT_READ)
            sel.register(self.master, selectors.EVENT_READ)
            while True:
                for key, _ in sel.select():
                    if key.fd == self.master:
                        try:
                            data = os.read(self.master, 1 << 16)
                        except OSError:
                            data = b""
                        if not data:
                            return
                        conn.sendall(data)
                    else:
                        data = conn.recv(1 << 16)
                        if not data:
                            return
                        self._to_pty(data)
        except OSError:
            return
        finally:
            sel.close()
            self.close()

    def close(self) -> None:
        """Hang up the pty; kill what is left of the shell's session."""
        os.close(self.master)
        if not self.child.wait(1.0):
            procfs.kill_session(self.child.pid, signal.SIGKILL)

    def _to_pty(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.master, data) :]
