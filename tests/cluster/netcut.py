"""Network cuts on this machine, as partitions between hosts would make them (nftables).

:class:`NetCut`: between the head and one host's server: every TCP packet to or from the
server's port is dropped (the head's connections hang, new ones get no answer). The host's
own side is untouched: its actor sees its server through the kernel, not the network.

:class:`RayCut`: between one Ray node and the rest of the Ray cluster (its GCS, the other
nodes, the driver), with its ``bunshin serve`` still reachable over HTTP. The node's
processes (raylet, workers, the host actor; not the server or its workspaces) are:

- moved into a cgroup v2 group of their own, so every socket they make from then on is
  matched by ``socket cgroupv2`` (the kernel ties a socket to the cgroup of its maker, at
  creation): its packets to anything but the node's own listeners are dropped;
- matched by their connections open at the cut (4-tuples, both directions), except the
  ones between two of the node's own processes;
- matched by their listening ports: a new connection from outside the node is dropped.

Both heal by deleting their table (and the cgroup, its processes moved back first).
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
import uuid
from pathlib import Path

import psutil

CGROUP2 = Path("/sys/fs/cgroup/unified")  # this machine's (empty) cgroup v2 hierarchy


def _nft(rules: str) -> None:
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)


class NetCut:
    def __init__(self, port: int) -> None:
        self.port = port
        self.table = f"bunshin_cut_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.active = False

    def cut(self) -> None:
        _nft(f"table inet {self.table} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n"
             f"  tcp dport {self.port} drop\n  tcp sport {self.port} drop\n }}\n}}\n")
        self.active = True

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=True, timeout=30)
            self.active = False

    def rules(self) -> str:
        return subprocess.run(["nft", "list", "table", "inet", self.table], capture_output=True, text=True).stdout


def _tree(roots: list[int], spare: set[int]) -> list[int]:
    """``roots`` and their descendants, without ``spare`` and what descends from it."""
    out: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in spare or pid in out:
            continue
        try:
            todo.extend(c.pid for c in psutil.Process(pid).children())
        except psutil.NoSuchProcess:
            continue
        out.append(pid)
    return out


def _v4(ip: str) -> str | None:
    """An IPv4 address as the packets carry it (an IPv6 socket's v4-mapped one too)."""
    ip = ip.removeprefix("::ffff:")
    return ip if ip.count(".") == 3 else None


def _tuple(a: tuple[str, int], b: tuple[str, int]) -> str:
    return f"{a[0]} . {a[1]} . {b[0]} . {b[1]}"


class RayCut:
    """Cut the processes of ``roots`` (a Ray node's own: its raylet; their descendants
    too) from everything outside them, sparing ``spare`` (the host's server: the head
    still reaches it over HTTP) and what it runs."""

    def __init__(self, roots: list[int], spare: set[int]) -> None:
        self.roots, self.spare = roots, spare
        tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.table = f"bunshin_raycut_{tag}"
        self.cgroup = CGROUP2 / f"bunshin-raycut-{tag}"
        self.pids: list[int] = []
        self.active = False

    def cut(self) -> None:
        self.cgroup.mkdir()
        self.active = True
        self.pids = _tree(self.roots, self.spare)
        for pid in self.pids:  # from now on every socket they make is matched by the cgroup
            try:
                (self.cgroup / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        listen: set[int] = set()
        conns: list[tuple[tuple[str, int], tuple[str, int]]] = []
        for pid in _tree(self.pids, self.spare):  # children made meanwhile are in the cgroup already
            try:
                for c in psutil.Process(pid).net_connections(kind="tcp"):  # Ray's: dual-stack, v4-mapped
                    if c.status == psutil.CONN_LISTEN:
                        listen.add(c.laddr.port)
                    elif c.raddr and (loc := _v4(c.laddr.ip)) and (rem := _v4(c.raddr.ip)):
                        conns.append(((loc, c.laddr.port), (rem, c.raddr.port)))
            except psutil.NoSuchProcess:
                pass
        mine = {local for local, _ in conns}
        inside = [(loc, rem) for loc, rem in conns if rem in mine or rem[1] in listen]
        outside = [(loc, rem) for loc, rem in conns if (loc, rem) not in inside]

        def tuples(pairs: list[tuple[tuple[str, int], tuple[str, int]]]) -> str:
            elements = ", ".join(sorted({t for loc, rem in pairs for t in (_tuple(loc, rem), _tuple(rem, loc))}))
            return f"  elements = {{ {elements} }}\n" if elements else ""

        ports = ", ".join(str(p) for p in sorted(listen))
        rel = self.cgroup.relative_to("/sys/fs/cgroup")
        four = "  type ipv4_addr . inet_service . ipv4_addr . inet_service\n"
        _nft(f"table inet {self.table} {{\n"
             f" set inside {{\n{four}{tuples(inside)} }}\n"
             f" set outside {{\n{four}{tuples(outside)} }}\n"
             " set listen {\n  type inet_service\n" + (f"  elements = {{ {ports} }}\n" if ports else "") + " }\n"
             " chain out {\n  type filter hook output priority 0; policy accept;\n"
             "  ip saddr . tcp sport . ip daddr . tcp dport @inside accept\n"
             "  ip saddr . tcp sport . ip daddr . tcp dport @outside drop\n"
             f"  socket cgroupv2 level 1 \"{rel}\" tcp dport @listen accept\n"
             f"  socket cgroupv2 level 1 \"{rel}\" drop\n"
             "  tcp dport @listen drop\n"
             " }\n}\n")

    def heal(self) -> None:
        if not self.active:
            return
        subprocess.run(["nft", "delete", "table", "inet", self.table], timeout=30)
        if self.cgroup.exists():
            # a process of the node may fork while its siblings are moved out (a new worker):
            # move until the cgroup stays empty, then remove it (bounded: 100 rounds, ~10 s)
            for _ in range(100):
                pids = (self.cgroup / "cgroup.procs").read_text().split()
                for pid in pids:
                    try:
                        (CGROUP2 / "cgroup.procs").write_text(pid)
                    except ProcessLookupError:
                        pass
                try:
                    self.cgroup.rmdir()
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    time.sleep(0.1)
            else:
                raise RuntimeError(f"{self.cgroup} kept tasks for 10 s: {(self.cgroup / 'cgroup.procs').read_text()!r}")
        self.active = False

    def rules(self) -> str:
        return subprocess.run(["nft", "list", "table", "inet", self.table], capture_output=True, text=True).stdout
