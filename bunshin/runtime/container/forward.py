"""The forwarder of one published port: a host process copying TCP both ways.

Run by ``publish.publish`` as ``python -m bunshin.runtime.container.forward FD PIDFD PID PORT``
with two inherited descriptors: FD, a listening socket on the host port (bound by the
caller, so a port in use is the caller's error), and PIDFD, a pidfd of the workspace's
pid 1 (``pidfd_open(2)``, taken while the record still named that process: a reused
pid cannot fool it). It forks once so its caller can reap the first process at once
(the forwarder then belongs to init), prints the forwarder's pid, and serves until the
pidfd turns readable (the workspace's pid 1 exited: removed, crashed, gc'd) or SIGTERM.

Each accepted connection gets a connection into the workspace's namespace to
``127.0.0.1:PORT`` (``port_socket``: the workspace sees a loopback client, so servers bound
to 127.0.0.1 are reached too) and two threads copying bytes, each passing on the end of
its stream with ``shutdown(SHUT_WR)``. A connection nothing answers inside is closed.
At most ``MAX_CONNECTIONS`` are served at once: one beyond is closed as it is accepted.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
import threading

from ...errors import BunshinError
from . import port_socket

PIECE = 1 << 16
#: Connections one forwarder serves at once (two host threads each); more are closed at once.
MAX_CONNECTIONS = 128


def _pump(src: socket.socket, dst: socket.socket, done: threading.Barrier) -> None:
    try:
        while data := src.recv(PIECE):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:  # either side reset: end both, which wakes the other pump's recv
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    try:
        done.wait()
    except threading.BrokenBarrierError:
        pass


def _serve(client: socket.socket, pid: int, port: int, held: threading.BoundedSemaphore) -> None:
    try:
        try:
            inside = port_socket.connect_port(pid, port)
        except (BunshinError, OSError):
            client.close()
            return
        def close_both() -> None:
            client.close()
            inside.close()

        done = threading.Barrier(2, action=close_both)
        threading.Thread(target=_pump, args=(inside, client, done), daemon=True).start()
        _pump(client, inside, done)
    finally:
        held.release()


def serve(listener: socket.socket, pidfd: int, pid: int, port: int) -> None:
    """Accept on ``listener`` until ``pidfd`` is readable (the workspace's pid 1 is gone)."""
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    held = threading.BoundedSemaphore(MAX_CONNECTIONS)
    while True:
        for key, _ in sel.select():
            if key.fileobj == pidfd:
                return
            client, _addr = listener.accept()
            if not held.acquire(blocking=False):
                client.close()
                continue
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_serve, args=(client, pid, port, held), daemon=True).start()


def main() -> None:
    fd, pidfd, pid, port = (int(a) for a in sys.argv[1:5])
    os.setsid()
    child = os.fork()
    if child:
        print(child, flush=True)
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(null, std)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve(socket.socket(fileno=fd), pidfd, pid, port)
    os._exit(0)  # pump threads may be mid-copy: the workspace is gone, so are their peers


if __name__ == "__main__":
    main()
