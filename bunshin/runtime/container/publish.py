"""Ports in: a workspace's TCP port published on a host port, like ``docker run -p``.

The mechanism is a forwarder process per published port (``forward``), which opens a
connection into the workspace's network namespace for each one it accepts
(``port_socket``), rather than nftables DNAT onto an egress veth: it works for every
workspace, with ``network=none`` (loopback only, the default) too, reaches servers bound
to 127.0.0.1 inside, and adds nothing to create or fork. It costs a copy through user
space per byte (see ``bunshin bench network``).

The host side binds here, in the caller, so a port in use or a bad address is the
caller's error at once; ``host_port`` None takes a free port. The forwarder lives until
the workspace's pid 1 exits (it holds a pidfd of it): ``remove`` and ``gc`` end it
without knowing of it. A clone never inherits a published port: the record is in the
workspace's own folder and names its pid 1. Records: ``<workspace folder>/publish/*.json``.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from ...config import Config
from ...errors import InvalidArgument, NotFound, ResourceExhausted, StateConflict
from ..state.records import WorkspaceRecord
from . import lifecycle
from .port_socket import MAX_PORT

LOCALHOST = "127.0.0.1"
#: Seconds for a forwarder to report its pid.
START_TIMEOUT_S = 10.0
#: Ports one workspace may have published at once: each is a host process (a forwarder).
MAX_PUBLISHED = 64


@dataclass(frozen=True)
class Published:
    """A workspace ``port`` reachable at ``host:host_port`` on the host."""

    port: int
    host: str
    host_port: int
    pid: int  # the forwarder's

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.host_port}" if ":" in self.host else f"{self.host}:{self.host_port}"


_SPEC = re.compile(r"(?:(?:(?P<host>\[[0-9a-fA-F:.]+\]|[0-9.]+):)?(?P<host_port>\d*):)?(?P<port>\d+)")


def parse(spec: str) -> tuple[int, int | None, str]:
    """``PORT``, ``HOST_PORT:PORT`` or ``HOST:HOST_PORT:PORT`` (docker's ``-p`` order; an
    empty HOST_PORT takes a free one) as (port, host_port, host)."""
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise InvalidArgument(f"cannot read the port mapping {spec!r}",
                              hint="write PORT, HOST_PORT:PORT or HOST:HOST_PORT:PORT, "
                                   "e.g. 8000, 8080:8000 or 127.0.0.1:8080:8000")
    host_port = int(m["host_port"]) if m["host_port"] else None
    return int(m["port"]), host_port, (m["host"] or LOCALHOST).strip("[]")


def _check(port: int, host_port: int | None, host: str) -> None:
    for name, value in (("port", port), ("host port", host_port)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PORT):
            raise InvalidArgument(f"{name} {value!r} is not a TCP port", hint=f"give a port in 1..{MAX_PORT}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise InvalidArgument(f"{host!r} is not an IP address of the host to listen on",
                              hint="give an address such as 127.0.0.1 (the default), ::1 or 0.0.0.0") from None


def _listen(host: str, host_port: int | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, host_port or 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StateConflict(f"host port {host}:{host_port} is in use",
                                hint="pick another host port, or leave it out to get a free one") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise InvalidArgument(f"{host} is not an address of this host",
                                  hint="listen on 127.0.0.1 (the default), 0.0.0.0 or one of `ip addr`") from None
        raise
    return sock


def publish(cfg: Config, rec: WorkspaceRecord, port: int, *, host_port: int | None = None,
            host: str = LOCALHOST) -> Published:
    """Forward ``host:host_port`` on the host to ``port`` inside the workspace ``rec``."""
    _check(port, host_port, host)
    if len(published(cfg, rec.id)) >= MAX_PUBLISHED:  # each a host process, outside the workspace's budgets
        raise ResourceExhausted(f"workspace {rec.id} has {MAX_PUBLISHED} ports published already",
                                hint="unpublish one first")
    if rec.pid is None or not lifecycle.is_alive(rec):
        raise StateConflict(f"workspace {rec.id} is not running: there is nothing to publish",
                            hint="publish ports of a running workspace")
    listener = _listen(host, host_port)
    try:
        pidfd = os.pidfd_open(rec.pid)
    except ProcessLookupError:
        listener.close()
        raise StateConflict(f"workspace {rec.id} stopped", hint="publish ports of a running workspace") from None
    try:
        if not lifecycle.is_alive(rec):  # pid 1 died (and its pid was reused) before pidfd_open
            raise StateConflict(f"workspace {rec.id} stopped", hint="publish ports of a running workspace")
        pid = _spawn(listener.fileno(), pidfd, rec.pid, port)
    finally:
        os.close(pidfd)
        bound = listener.getsockname()
        listener.close()  # the forwarder holds its own copy
    out = Published(port=port, host=host, host_port=int(bound[1]), pid=pid)
    folder = _folder(cfg, rec.id)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{out.host_port}-{host}.json").write_text(json.dumps({**asdict(out), "start": _start(pid)}))
    return out


def _spawn(fd: int, pidfd: int, pid: int, port: int) -> int:
    run = subprocess.run([sys.executable, "-m", f"{__package__}.forward", str(fd), str(pidfd), str(pid), str(port)],
                         pass_fds=(fd, pidfd), capture_output=True, text=True, timeout=START_TIMEOUT_S,
                         check=False, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if run.returncode or not run.stdout.strip().isdigit():
        raise StateConflict(f"the forwarder for port {port} did not start: {run.stderr.strip()[-400:]}",
                            hint="see the message; `bunshin doctor` checks the host")
    return int(run.stdout)


def _folder(cfg: Config, ws_id: str) -> Path:
    return cfg.paths.workspace(ws_id) / "publish"


def _start(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def _alive(entry: dict[str, object]) -> bool:
    return entry.get("start") is not None and _start(int(str(entry["pid"]))) == entry["start"]


def published(cfg: Config, ws_id: str) -> list[Published]:
    """The ports of workspace ``ws_id`` published now (a forwarder that is gone is left out)."""
    folder = _folder(cfg, ws_id)
    out = []
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            entry = json.loads(f.read_text())
            if _alive(entry):
                out.append(Published(port=entry["port"], host=entry["host"], host_port=entry["host_port"],
                                     pid=entry["pid"]))
    return out


def unpublish(cfg: Config, ws_id: str, host_port: int) -> None:
    """Stop forwarding ``host_port`` (every host address it was published on)."""
    folder = _folder(cfg, ws_id)
    found = sorted(folder.glob(f"{host_port}-*.json")) if folder.is_dir() else []
    if not found:
        raise NotFound(f"host port {host_port} is not published for workspace {ws_id}",
                              hint="see `bunshin port WS` for its published ports")
    for f in found:
        with contextlib.suppress(OSError, ValueError):
            entry = json.loads(f.read_text())
            if _alive(entry):
                os.kill(int(entry["pid"]), signal.SIGTERM)
        f.unlink(missing_ok=True)
