"""A TCP connection from the host to a port inside a workspace's network namespace.

A socket belongs for its whole life to the network namespace its creator was in at
``socket(2)`` (the kernel takes ``current->nsproxy->net_ns``), whichever thread uses it
later. ``setns(2)`` with ``CLONE_NEWNET`` moves only the calling thread. So a short-lived
thread joins the workspace's namespace (through ``/proc/<pid 1>/ns/net``), makes the
socket and connects it to ``127.0.0.1:<port>`` there, joins the host's namespace again
and ends; the socket is handed back and used from any thread. No other thread of the
host ever leaves the host's namespace, and the workspace sees a loopback client.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Callable

from ...errors import InvalidArgument, StateConflict, Unreachable
from ..kernel import syscalls as sc

#: Largest TCP port number.
MAX_PORT = 65535


def connect_port(pid: int, port: int, *, timeout: float = 5.0,
                 still_ours: Callable[[], bool] | None = None) -> socket.socket:
    """A TCP socket connected to ``127.0.0.1:port`` in the network namespace of host
    process ``pid`` (a workspace's pid 1), blocking, ``TCP_NODELAY`` set; the caller
    closes it. ``Unreachable`` when nothing listens there, ``StateConflict`` when the
    process is gone. ``still_ours`` is asked once the namespace is open: a pid that died
    and was reused by another process before the open would otherwise name its network
    (the host's, say)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= MAX_PORT:
        raise InvalidArgument(f"port {port!r} is not a TCP port", hint=f"give a port in 1..{MAX_PORT}")
    try:
        theirs = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise StateConflict(f"process {pid} is gone: its network cannot be reached",
                            hint="the workspace stopped; create a new one") from None
    result: list[socket.socket | BaseException] = []
    try:
        if still_ours is not None and not still_ours():
            raise StateConflict(f"process {pid} is gone: its network cannot be reached",
                                hint="the workspace stopped; create a new one")
        t = threading.Thread(target=_connect_in, args=(theirs, port, timeout, result),
                             name="bunshin-port-socket", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(theirs)
    got = result[0]
    if isinstance(got, socket.socket):
        return got
    if isinstance(got, ConnectionRefusedError | TimeoutError) or (
            isinstance(got, OSError) and got.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH)):
        raise Unreachable(f"nothing answers on port {port} inside the workspace ({got})",
                          hint="start a server listening on that port (on 0.0.0.0 or 127.0.0.1) in the workspace "
                               "first") from None
    raise got


def _connect_in(theirs: int, port: int, timeout: float, result: list[socket.socket | BaseException]) -> None:
    """In a thread of its own: join the namespace ``theirs``, connect, come back."""
    try:
        ours = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        result.append(e)
        return
    try:
        sc.setns(theirs, sc.CLONE_NEWNET)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # born in the workspace's netns
        finally:
            sc.setns(ours, sc.CLONE_NEWNET)  # back before anything else runs on this thread
        try:
            sock.settimeout(timeout)
            sock.connect(("127.0.0.1", port))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        result.append(sock)
    except BaseException as e:  # handed to the caller
        result.append(e)
    finally:
        os.close(ours)
