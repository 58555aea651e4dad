"""The host's resolver for workspaces with egress: answers only the names a policy allows,
and admits exactly the addresses it answered.

One process per home (``python -m bunshin.runtime.net.resolver SPEC``), started by the
first workspace with egress and stopped with the last (``ensure`` / ``stop_if_idle``);
recorded in the store (kind ``netresolver``) so gc finds it. It listens on UDP
``port(cfg)`` of every address; each workspace's table redirects the workspace's DNS
(UDP 53 to any address) to its gateway at that port (``egress.table_text``). A query is
taken by its source address to the workspace's slot, and so to its policy (read from
the store per query: a change applies to the next query). A name the policy does not
allow is answered REFUSED; an allowed one is asked of the upstream servers, and the A
records of the answer are added to the workspace's ``named4`` set for the answer's TTL
before the answer is sent back (the kernel then lets exactly those addresses through).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdatatype
import psutil

from ...config import Config
from ...errors import RuntimeFailure
from ..state.store import Store

KIND = "netresolver"
MIN_TTL_S = 5  # an admitted address stays at least this long (a TTL of 0 would admit nothing)
MAX_TTL_S = 3600  # and at most this long (an upstream's TTL is up to 68 years: it outlives a policy change)
IDLE_CHECK_S = 2.0
WORKERS = 16  # queries answered at once, for every workspace of the home
PER_SOURCE = 4  # of which one workspace's at most


def port(cfg: Config) -> int:
    """The resolver's UDP port for this home (fixed: tables name it before it starts)."""
    from .slots import tag  # noqa: PLC0415

    return 20000 + int(tag(cfg), 16) % 20000


def upstreams(cfg: Config) -> list[str]:
    """The servers allowed names are asked of: the config's, else ``BUNSHIN_DNS_UPSTREAM``
    (comma-separated addresses), else the nameservers of the host's /etc/resolv.conf."""
    if cfg.dns_upstream:
        return list(cfg.dns_upstream)
    if os.environ.get("BUNSHIN_DNS_UPSTREAM"):
        return [a.strip() for a in os.environ["BUNSHIN_DNS_UPSTREAM"].split(",") if a.strip()]
    with contextlib.suppress(OSError):
        with open("/etc/resolv.conf") as f:
            return [ln.split()[1] for ln in f if ln.startswith("nameserver") and len(ln.split()) > 1]
    return []


def _alive(store: Store) -> int | None:
    data = store.get_object(KIND, "0")
    if data is None:
        return None
    pid = int(json.loads(data)["pid"])
    try:
        if "bunshin.runtime.net.resolver" in " ".join(psutil.Process(pid).cmdline()):
            return pid
    except psutil.Error:
        pass
    return None


def ensure(cfg: Config, store: Store) -> int:
    """The home's resolver, started if it is not running; its pid."""
    with store.transaction():
        pid = _alive(store)
        if pid is not None:
            return pid
        with _bound(port(cfg)) as sock:  # bound here: a taken port is an error now, not silent DNS failure
            spec = {"home": str(cfg.home), "pool": cfg.net_pool, "port": port(cfg), "upstream": upstreams(cfg),
                    "fd": sock.fileno()}
            proc = subprocess.Popen([sys.executable, "-m", "bunshin.runtime.net.resolver", json.dumps(spec)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True, close_fds=True, pass_fds=(sock.fileno(),),
                                    env={"PATH": os.environ.get("PATH", ""),
                                         "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
        store.put_object(KIND, "0", json.dumps({"pid": proc.pid}))
        return proc.pid


def _bound(udp_port: int) -> socket.socket:
    """A UDP socket bound to ``udp_port`` on every address of the host's network namespace."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("0.0.0.0", udp_port))
    except OSError as e:
        sock.close()
        holder = _holder(udp_port)
        raise RuntimeFailure(
            f"the workspaces' DNS resolver cannot listen on UDP port {udp_port}: {e.strerror}"
            f"{f' (held by {holder})' if holder else ''}",
            hint="free the port, or give this bunshin home another BUNSHIN_HOME (the port follows the home)",
            port=udp_port) from e
    return sock


def _holder(udp_port: int) -> str | None:
    """Who holds ``udp_port``, as ``pid N (name)``, if it can be told."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections("udp4"):
            if conn.laddr and conn.laddr.port == udp_port and conn.pid:
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    return None


def stop_if_idle(store: Store) -> None:
    """Stop the home's resolver if no slot is held."""
    if store.list_objects("netslot"):
        return
    pid = _alive(store)
    store.delete_object(KIND, "0")
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(5)


# ----------------------------------------------------------------- the process


def _answer(cfg: Config, store: Store, spec: dict[str, Any], wire: bytes, source: str) -> bytes | None:
    from . import nft  # noqa: PLC0415
    from .slots import Slot, policy_of  # noqa: PLC0415

    try:
        query = dns.message.from_wire(wire)
    except Exception:  # noqa: BLE001 - not DNS: no answer
        return None
    net = ipaddress.IPv4Network(spec["pool"])
    offset = int(ipaddress.IPv4Address(source)) - int(net.network_address)
    if not (0 <= offset < net.num_addresses and offset % 4 == 2):
        return None  # not a workspace's address: no answer (the socket is on every address)
    policy = policy_of(store, offset // 4)
    name = query.question[0].name.to_text().rstrip(".") if len(query.question) == 1 else ""
    if policy is None or not name or not policy.allows_name(name) or not spec["upstream"]:
        reply = dns.message.make_response(query)
        reply.set_rcode(dns.rcode.REFUSED)
        return reply.to_wire()
    try:
        reply = dns.query.udp(query, spec["upstream"][0], timeout=3)
    except Exception:  # noqa: BLE001 - the upstream failed: SERVFAIL
        reply = dns.message.make_response(query)
        reply.set_rcode(dns.rcode.SERVFAIL)
        return reply.to_wire()
    # Only a name the policy allows by name admits its addresses past deny and always
    # denied: with no allow rule every name is answered, and a name the workload chose
    # (rebinding to metadata, a private range, the pool) must not open those.
    # Only the asked name's own records (through its CNAME chain) admit: an answer naming
    # other owners is not what was asked.
    elements = [f"{rd.address} timeout {min(max(rrset.ttl, MIN_TTL_S), MAX_TTL_S)}s"
                for rrset in _asked(reply, query.question[0].name) for rd in rrset] if policy.restricted else []
    if elements:
        table = Slot.of(cfg, offset // 4).table
        nft.run(f"add element inet {table} named4 {{ {', '.join(elements)} }}")
    return reply.to_wire()


def _asked(reply: dns.message.Message, name: dns.name.Name) -> list[Any]:
    """The A record sets of ``reply`` owned by ``name`` or a name its CNAME chain leads to."""
    owners = {name}
    for _ in range(8):  # a chain is short; a loop in one ends here
        more = {rd.target for rrset in reply.answer if rrset.rdtype == dns.rdatatype.CNAME and rrset.name in owners
                for rd in rrset} - owners
        if not more:
            break
        owners |= more
    return [rrset for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A and rrset.name in owners]


def serve(spec: dict[str, Any]) -> None:
    """Answer queries until no workspace with egress is left. Each query is answered in a
    worker (``WORKERS``), so an upstream that never answers holds up only that query; a
    workspace has at most ``PER_SOURCE`` queries in flight, the ones past it are dropped
    (its resolver library asks again), so one workspace cannot take every worker."""
    cfg = dataclasses.replace(Config.for_home(Path(spec["home"])), net_pool=spec["pool"])
    if "fd" in spec:  # bound by ``ensure``
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, fileno=spec["fd"])
    else:
        sock = _bound(spec["port"])
    sock.settimeout(IDLE_CHECK_S)
    in_flight: dict[str, int] = {}
    lock = threading.Lock()

    def answer(wire: bytes, source: str, sport: int) -> None:
        try:
            with contextlib.suppress(Exception), Store.open(cfg.db_path) as store:  # one bad query ends nothing
                out = _answer(cfg, store, spec, wire, source)
                if out is not None:
                    sock.sendto(out, (source, sport))
        finally:
            with lock:
                in_flight[source] -= 1
                if not in_flight[source]:
                    del in_flight[source]

    with Store.open(cfg.db_path) as store, ThreadPoolExecutor(WORKERS, "bunshin-dns") as pool:
        while True:
            try:
                wire, (source, sport) = sock.recvfrom(4096)
            except TimeoutError:
                if not store.list_objects("netslot"):
                    return  # no workspace with egress left
                continue
            with lock:
                if in_flight.get(source, 0) >= PER_SOURCE:
                    continue
                in_flight[source] = in_flight.get(source, 0) + 1
            pool.submit(answer, wire, source, sport)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(json.loads(sys.argv[1]))
