"""A stand-in for the internet: servers in a network namespace of their own, routed from the host.

``with Internet.start(folder) as inet:`` makes, for the tests and ``bunshin bench network``:

- a veth link ``bsinet<k>``: the host holds ``198.51.100.(4k+1)/30``, the namespace
  ``.(4k+2)``; the host routes ``203.0.113.(8k)/29`` (TEST-NET-3, RFC 5737: never on the
  real internet) through it, so a workspace whose egress the host routes and NATs reaches
  these addresses as it would reach the internet (the host must forward: egress's job);
- HTTP on port 80 at ``inet.web`` and ``inet.other`` (two hosts for allow/deny tests):
  ``/files/<path>`` (the folder ``inet.files``), ``/bytes/<n>`` (n bytes as fast as the
  link goes: byte i is ``i % 256``), ``/slow/<n>?rate=<bytes/s>`` (the same, paced: a
  download to fork in the middle of; 256 KiB/s by default), ``/whoami`` (the client's
  address as the server saw it, i.e. after NAT);
- a package index (PEP 503) at ``inet.index_url`` serving the wheels in ``inet.wheels``
  (``bunshin-netprobe`` 1.0, importable as ``netprobe``, which depends on
  ``bunshin-netprobe-dep``: written at start);
- DNS (UDP and TCP 53) at ``inet.dns`` answering the names of ``inet.names()`` (``web.inet.test``,
  ``other.inet.test``, ``pypi.inet.test`` to start with; ``add_name`` more, ``*.zone``
  wildcards too), NXDOMAIN for the rest (needs dnspython; ``dns=False`` leaves it out);
- a log: ``inet.requests()`` (each HTTP request: client address and port, path, bytes
  sent, the error that ended it, e.g. ``ConnectionResetError``) and ``inet.dns_queries()``.

Slots ``k`` (0..31) are taken with a lock file each, so test runs side by side get their
own addresses. The servers are one process, ``unshare --net`` of ``inet_servers.py``,
reading its stdin: when this process dies the pipe closes, it exits, and the kernel
deletes the namespace with the link and the host's route. ``close`` does the same at once.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import select
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SLOTS = 32
LINKS = ipaddress.ip_network("198.51.100.0/24")  # TEST-NET-2: a /30 per slot
SERVERS = ipaddress.ip_network("203.0.113.0/24")  # TEST-NET-3: a /29 per slot
LOCKS = Path("/run/lock/bunshin-inet")
READY_S = 15.0

_PROBES = {  # project -> (module source, dependencies)
    "bunshin-netprobe": ("from netprobe_dep import ANSWER\n", ["bunshin-netprobe-dep"]),
    "bunshin-netprobe-dep": ("ANSWER = 42\n", []),
}


class InternetError(RuntimeError):
    """The test internet could not be set up (the message says which step)."""


@dataclass
class Internet:
    """A running test internet; addresses are strings, ``root`` holds its files."""

    slot: int
    link: str
    host_addr: str
    peer_addr: str
    subnet: str
    web: str
    other: str
    index: str
    dns: str | None
    root: Path
    _proc: subprocess.Popen[str] | None = field(default=None, repr=False)
    _lock: IO[str] | None = field(default=None, repr=False)

    @property
    def files(self) -> Path:
        return self.root / "files"

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    @property
    def index_url(self) -> str:
        return f"http://{self.index}/simple/"

    @property
    def pip_args(self) -> list[str]:
        """``pip install`` options that take packages from this index only (with the
        environment ``PIP_CONFIG_FILE=/dev/null``, so no configured index is added)."""
        return ["--index-url", self.index_url, "--trusted-host", self.index, "--no-cache-dir",
                "--disable-pip-version-check"]

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.web}/{path.lstrip('/')}"

    @property
    def netns(self) -> str:
        """The servers' network namespace, as a path ``nsenter --net=`` takes."""
        assert self._proc is not None, "the test internet is closed"
        return f"/proc/{self._proc.pid}/ns/net"

    def add_address(self, addr: str) -> None:
        """Hold ``addr`` in the namespace too, routed from the host through the link (a
        canary: e.g. 169.254.169.254 or a private address, to show a policy refuses
        what the host itself reaches). The route goes with the link."""
        _ip(batch=[f"addr replace {addr}/32 dev lo"], netns=self.netns)
        _ip("route", "replace", f"{addr}/32", "via", self.peer_addr, "dev", self.link)

    def remove_address(self, addr: str) -> None:
        """Undo ``add_address``."""
        subprocess.run(["ip", "route", "del", f"{addr}/32", "via", self.peer_addr], capture_output=True, check=False)
        subprocess.run(["nsenter", f"--net={self.netns}", "ip", "addr", "del", f"{addr}/32", "dev", "lo"],
                       capture_output=True, check=False)

    def names(self) -> dict[str, list[str]]:
        return dict(json.loads((self.root / "names.json").read_text()))

    def add_name(self, name: str, *addrs: str) -> None:
        """Answer ``name`` (or ``*.zone``) with ``addrs`` from now on (none: remove it)."""
        names = self.names()
        if addrs:
            names[name.lower().rstrip(".")] = list(addrs)
        else:
            names.pop(name.lower().rstrip("."), None)
        tmp = self.root / "names.json.tmp"
        tmp.write_text(json.dumps(names))
        tmp.rename(self.root / "names.json")

    def requests(self) -> list[dict[str, Any]]:
        return [e for e in self._log() if e["kind"] == "http"]

    def wait_request(self, path: str, *, timeout: float = 5.0) -> dict[str, Any]:
        """The first logged request for ``path`` (logged when its response ends), waiting
        up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        while not (found := [r for r in self.requests() if r["path"] == path]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no request for {path} reached the test internet in {timeout} s")
            time.sleep(0.05)
        return found[0]

    def dns_queries(self) -> list[dict[str, Any]]:
        return [e for e in self._log() if e["kind"] == "dns"]

    def _log(self) -> list[dict[str, Any]]:
        path = self.root / "log.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.exists() else []

    @classmethod
    @contextlib.contextmanager
    def start(cls, root: Path, *, dns: bool = True) -> Iterator[Internet]:
        """Set it up in ``root`` (a folder of the caller's), yield it, take it all down."""
        inet = _setup(Path(root), dns=dns)
        try:
            yield inet
        finally:
            inet.close()

    def close(self) -> None:
        """Take it down: the link (and with it the route), the servers, the slot."""
        subprocess.run(["ip", "link", "del", self.link], capture_output=True, check=False)
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
            self._proc = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _take_slot() -> tuple[int, IO[str]]:
    LOCKS.mkdir(parents=True, exist_ok=True)
    for k in range(SLOTS):
        f = open(LOCKS / f"{k}.lock", "w")  # noqa: SIM115 - held for the internet's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        return k, f
    raise InternetError(f"all {SLOTS} test-internet slots are taken ({LOCKS}): too many test runs at once")


def _ip(*args: str, netns: str | None = None, batch: list[str] | None = None) -> None:
    cmd = ["ip", *args] if batch is None else ["ip", "-batch", "-"]
    if netns is not None:
        cmd = ["nsenter", f"--net={netns}", *cmd]
    run = subprocess.run(cmd, input="\n".join(batch or []), capture_output=True, text=True, check=False)
    if run.returncode:
        raise InternetError(f"{' '.join(cmd)} {batch or ''} failed: {run.stderr.strip()}")


def _setup(root: Path, *, dns: bool) -> Internet:
    k, lock = _take_slot()
    link = [LINKS[4 * k + i] for i in range(4)]
    srv = [SERVERS[8 * k + i] for i in range(8)]
    inet = Internet(slot=k, link=f"bsinet{k}", host_addr=str(link[1]), peer_addr=str(link[2]),
                    subnet=f"{srv[0]}/29", web=str(srv[1]), other=str(srv[2]), index=str(srv[3]),
                    dns=str(srv[4]) if dns else None, root=root, _lock=lock)
    try:
        _folders(inet)
        subprocess.run(["ip", "link", "del", inet.link], capture_output=True, check=False)  # a dead run's
        _ip("link", "add", inet.link, "type", "veth", "peer", "name", f"{inet.link}p")
        inet._proc = proc = _spawn(inet)  # noqa: SLF001 - its own record, being built
        _expect(proc, "netns", root)
        pid = proc.pid
        _ip("link", "set", f"{inet.link}p", "netns", str(pid))
        _ip(batch=[f"addr add {inet.host_addr}/30 dev {inet.link}", f"link set {inet.link} up",
                   f"route add {inet.subnet} via {inet.peer_addr} dev {inet.link}"])
        inside = ["link set lo up", f"addr add {inet.peer_addr}/30 dev {inet.link}p", f"link set {inet.link}p up",
                  f"route add default via {inet.host_addr}"]
        inside += [f"addr add {a}/32 dev lo" for a in (inet.web, inet.other, inet.index, inet.dns) if a]
        _ip(netns=f"/proc/{pid}/ns/net", batch=inside)
        _wait_ready(proc, root)
    except BaseException:
        inet.close()
        raise
    return inet


def _folders(inet: Internet) -> None:
    inet.files.mkdir(parents=True, exist_ok=True)
    (inet.files / "hello.txt").write_text("hello from the test internet\n")
    (inet.root / "names.json").write_text(json.dumps({
        "web.inet.test": [inet.web], "other.inet.test": [inet.other], "pypi.inet.test": [inet.index]}))
    (inet.root / "log.jsonl").write_text("")
    build_wheels(inet.wheels)


def build_wheels(dest: Path) -> list[Path]:
    """The probe wheels, written into ``dest`` as the wheel format (PEP 427) says: a zip of
    the package, ``METADATA``, ``WHEEL`` and a ``RECORD`` of sha256 digests. Written rather
    than built with ``pip wheel`` of a source tree, which costs ~6 s of CPU per build."""
    dest.mkdir(parents=True, exist_ok=True)
    for project, (code, deps) in _PROBES.items():
        module = project.removeprefix("bunshin-").replace("-", "_")
        dist = f"{project.replace('-', '_')}-1.0"
        files = {
            f"{module}/__init__.py": code,
            f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\n" f"Name: {project}\nVersion: 1.0\n"
            + "".join(f"Requires-Dist: {d}\n" for d in deps),
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: bunshin\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        }
        record = [f"{name},sha256={_digest(text.encode())},{len(text.encode())}" for name, text in files.items()]
        files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
        with zipfile.ZipFile(dest / f"{dist}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as whl:
            for name, text in files.items():
                whl.writestr(name, text)
    return sorted(dest.glob("*.whl"))


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _spawn(inet: Internet) -> subprocess.Popen[str]:
    spec = {"web": [inet.web, inet.other], "index": inet.index, "dns": inet.dns, "files": str(inet.files),
            "wheels": str(inet.wheels), "names": str(inet.root / "names.json"), "log": str(inet.root / "log.jsonl")}
    script = Path(__file__).with_name("inet_servers.py")
    err = open(inet.root / "servers.err", "w")  # noqa: SIM115 - the child holds its own copy
    proc = subprocess.Popen(["unshare", "--net", "--", sys.executable, str(script), json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    err.close()
    return proc


def _wait_ready(proc: subprocess.Popen[str], root: Path) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    _expect(proc, "ready", root)


def _expect(proc: subprocess.Popen[str], word: str, root: Path) -> None:
    """The servers' next line is ``word``, within READY_S, or the start failed."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_S)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != word:
        proc.kill()
        proc.wait(5)
        err = (root / "servers.err").read_text()
        raise InternetError(f"the test internet's servers did not say {word!r} in {READY_S:.0f} s: {err.strip()[-800:]}")
