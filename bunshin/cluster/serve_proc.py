"""One host's ``bunshin serve``, run as a child process with that host's home.

The cluster's hosts share one snapshot key (a root saved on one loads on another):
it is written into the home before the server starts. The server listens on
``bind`` (loopback, or the address of an interface the operator names:
:func:`resolve_bind`) at a free port, with the token its owner sets
(:meth:`ServeProcess.set_token`: derived from the cluster secret, per host and epoch).
It is told to stop (SIGTERM, then SIGKILL) when its owner stops it, and gets
SIGTERM if its owner dies (``PR_SET_PDEATHSIG``): a host that goes away leaves its
workspaces to ``bunshin gc`` or to the next start's re-adoption.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ..config import Config
from ..errors import InvalidArgument, RuntimeFailure
from ..runtime.kernel import syscalls
from .records import HostLimits

PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 60.0
LOG_NAME = "cluster-serve.log"


def install_key(cfg: Config, key: bytes) -> None:
    """Make ``key`` the home's snapshot key (mode 0600, never through a symlink).

    A home that already holds another key is refused: the folders it saved would no
    longer load."""
    if len(key) != 32:
        raise InvalidArgument("a snapshot key is 32 bytes", hint="derive it from the cluster secret (ClusterSecret)")
    path = cfg.snapshot_key_path
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            held = os.read(fd, 64)
        finally:
            os.close(fd)
        if held != key:
            raise InvalidArgument(f"{path} holds another snapshot key than the cluster's",
                                  hint="give this host a home of its own for the cluster (--home-root); a home "
                                       "keeps the key it saved with") from None
        return
    try:
        os.write(fd, key)
    finally:
        os.close(fd)


def resolve_bind(spec: str) -> str:
    """The address ``spec`` names on this machine: an IP address as it is, else the
    interface of that name (``wg0``, ``eth1``): its IPv4 address (else its first IPv6 one
    that is not link-local)."""
    try:
        return str(ipaddress.ip_address(spec))
    except ValueError:
        pass
    addrs = psutil.net_if_addrs().get(spec)
    if addrs is None:
        raise InvalidArgument(f"--bind {spec!r} is neither an IP address nor an interface of this machine",
                              hint=f"give an address, or one of {', '.join(sorted(psutil.net_if_addrs()))}")
    v4 = [a.address for a in addrs if a.family == socket.AF_INET]
    v6 = [a.address for a in addrs if a.family == socket.AF_INET6 and not a.address.startswith("fe80")]
    if not v4 + v6:
        raise InvalidArgument(f"interface {spec!r} has no address", hint="give one that is up, or an address")
    return (v4 + v6)[0]


def write_token(path: Path, token: str) -> bool:
    """``token`` into ``path`` (mode 0600, replaced whole, never through a symlink);
    whether it changed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.read(fd, 4096).decode(errors="replace").strip() == token:
                return False
        finally:
            os.close(fd)
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return True


def free_port(bind: str) -> int:
    """A TCP port free on ``bind`` right now."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    syscalls.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServeProcess:
    """``bunshin serve`` for ``home`` on ``bind``; :meth:`start`, :meth:`stop`."""

    def __init__(self, home: Path, *, bind: str = "127.0.0.1", limits: HostLimits | None = None,
                 key: bytes | None = None, criu: Path | None = None) -> None:
        self.cfg = Config.for_home(home, criu=criu or Config.from_env().criu)
        self.bind = bind
        self.limits = limits or HostLimits()
        self.key = key
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}"

    @property
    def token_file(self) -> Path:
        return self.cfg.paths.server_token

    def token(self) -> str:
        from ..server.token import ensure_token

        return ensure_token(self.token_file)

    def set_token(self, token: str) -> bool:
        """The token the server takes at its next start; whether it changed."""
        return write_token(self.token_file, token)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, timeout: float = START_TIMEOUT_S) -> str:
        """Start it (the key installed first) and wait until it answers; its URL."""
        if self.key is not None:
            install_key(self.cfg, self.key)
        self.token()  # made here, mode 0600, so the owner can read it before the server runs
        env = {k: v for k, v in os.environ.items() if k not in ("BUNSHIN_TMPFS", "BUNSHIN_TOKEN", "BUNSHIN_URL")}
        env.update(BUNSHIN_HOME=str(self.cfg.home), BUNSHIN_CRIU=str(self.cfg.criu))
        log = open(self.cfg.home / LOG_NAME, "ab")  # the child keeps its own copy
        try:
            for attempt in range(5):  # a port taken between the probe and the bind: try another
                # a restart keeps its port (the head's URL for it holds), if it is free
                if attempt or self.port is None:
                    self.port = free_port(self.bind)
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "bunshin.cli.main", "serve", "--host", self.bind, "--port",
                     str(self.port), "--token-file", str(self.token_file), "--shutdown-grace", "5",
                     *self.limits.serve_args()],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, preexec_fn=_die_with_parent,
                    close_fds=True)
                if self._wait_healthy(timeout):
                    return self.url
        finally:
            log.close()
        raise RuntimeFailure(f"bunshin serve for {self.cfg.home} did not start",
                             hint=f"see {self.cfg.home / LOG_NAME}")

    def _wait_healthy(self, timeout: float) -> bool:
        """Until the child itself listens on its port (uvicorn binds once the app has
        started): asked of the kernel, not over the network, so a host cut off from the
        head still knows its server is up, and another process on the port is not taken
        for it."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self._listening():
                return True
            time.sleep(0.1)
        self.stop()
        return False

    def _listening(self) -> bool:
        assert self.proc is not None
        try:
            conns = psutil.Process(self.proc.pid).net_connections(kind="tcp")
        except psutil.Error:
            return False
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port for c in conns)

    def stop(self, *, grace: float = 10.0) -> None:
        """SIGTERM (calls in flight drain), then SIGKILL after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would: what it held stays for ``bunshin gc``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def clear_home(cfg: Config, *, release: bool = False) -> dict[str, int]:
    """Every workspace and snapshot of a host's home removed, then ``bunshin gc`` (its
    server must be stopped): for a cluster host whose work the head gave up on, or a
    benchmark's simulated hosts. ``release``: its tmpfs unmounted after. What went, by kind."""
    from ..runtime import snapshot as rsnap
    from ..runtime.container import lifecycle as container
    from ..runtime.state.store import Store
    from ..runtime.upkeep import gc

    with Store.open(cfg.db_path) as store:
        workspaces = store.list_workspaces()
        for rec in workspaces:
            container.destroy(cfg, store, rec)
        snapshots = rsnap.list_all(store)
        for snap in snapshots:
            rsnap.remove(cfg, store, snap)
        report = gc.collect(cfg, store, release=release)
    return {"workspaces": len(workspaces), "snapshots": len(snapshots), "gc": report.total}
