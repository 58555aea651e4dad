"""Integration: a workspace's way out (veth, NAT, nftables policy) against the test internet.

Traffic goes only to loopback and namespaces the tests make (``internet``: TEST-NET
servers behind a host link; canary addresses added to its namespace for the run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import textwrap

import httpx
import psutil
import pytest

from bunshin.errors import InvalidArgument, StateConflict
from bunshin.runtime.net import attach, egress, slots
from bunshin.runtime.net.policy import Policy
from bunshin.runtime.state.store import Store
from bunshin.workspace import Workspace

pytestmark = pytest.mark.integration

# Addresses that are always refused, each served by the test internet for this module
# (the host reaches them: the refusal is the policy's, not a missing server)
CANARIES = ("169.254.169.254", "10.99.0.1", "172.16.99.1", "192.168.99.1", "100.64.99.1")

PROBE = textwrap.dedent("""
    import json, socket, sys
    out = {}
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        s = socket.socket()
        s.settimeout(3)
        try:
            s.connect((host, int(port)))
            out[target] = "ok"
        except OSError as e:
            out[target] = type(e).__name__ if e.errno is None else __import__("errno").errorcode[e.errno]
        finally:
            s.close()
    print(json.dumps(out))
""")


def probe(ws: Workspace, *targets: str) -> dict[str, str]:
    """Connect from inside ``ws`` to each ``host:port``: "ok" or the error's name."""
    r = ws.exec(["python3", "-c", PROBE, *targets], timeout=30)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def fetch(ws: Workspace, url: str) -> str:
    r = ws.exec(["python3", "-c", f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).read().decode())"],
                timeout=30)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


CANARY_PORT = 8088


@pytest.fixture(scope="module")
def canaries(internet, tmp_path_factory):
    """The canary addresses on the internet's namespace, routed from the host, with an
    HTTP server on every address of that namespace at ``CANARY_PORT``."""
    netns = f"--net=/proc/{internet._proc.pid}/ns/net"  # noqa: SLF001 - the fixture's own namespace
    server = subprocess.Popen(["nsenter", netns, "python3", "-m", "http.server", str(CANARY_PORT), "--bind", "0.0.0.0",
                               "--directory", str(tmp_path_factory.mktemp("canary"))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # the server and whatever was added go also when an add fails
        for addr in CANARIES:
            subprocess.run(["nsenter", netns, "ip", "addr", "replace", f"{addr}/32", "dev", "lo"], check=True)
            subprocess.run(["ip", "route", "replace", f"{addr}/32", "via", internet.peer_addr, "dev", internet.link],
                           check=True)  # replace: the same route another user of this internet left is no error
        with httpx.Client(timeout=5) as http:
            for addr in CANARIES:  # the host reaches each
                assert _eventually(lambda a=addr: _get_ok(http, f"http://{a}:{CANARY_PORT}/"))
        yield CANARIES
    finally:
        server.kill()
        server.wait()
        for addr in CANARIES:
            subprocess.run(["ip", "route", "del", f"{addr}/32", "via", internet.peer_addr, "dev", internet.link],
                           check=False, capture_output=True)  # only the route this fixture added
            subprocess.run(["nsenter", netns, "ip", "addr", "del", f"{addr}/32", "dev", "lo"], check=False,
                           capture_output=True)


def _get_ok(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.TransportError:
        return False


def own_leftovers(cfg) -> dict[str, list]:
    with Store.open(cfg.db_path) as store:
        held = slots.held(store)
        resolver = store.list_objects("netresolver")
    links, tables = egress.leftovers(cfg, set())
    procs = [p.pid for p in psutil.process_iter(["cmdline"])
             if "bunshin.runtime.net.resolver" in " ".join(p.info["cmdline"] or []) and str(cfg.home) in
             " ".join(p.info["cmdline"] or [])]
    return {k: v for k, v in (("slots", list(held)), ("links", links), ("tables", tables),
                              ("resolver_records", resolver), ("resolvers", procs)) if v}


@pytest.fixture(scope="module")
def ncfg(cfg, internet):
    """The session's config with the test internet's DNS as the resolver's upstream (no
    query leaves the test's namespaces)."""
    return dataclasses.replace(cfg, dns_upstream=(internet.dns,))


@pytest.fixture(scope="module")
def pair(ncfg, internet):
    """Two workspaces with egress (the second restricted to the internet's subnet) and one without."""
    made: list[Workspace] = []
    try:
        made.append(Workspace.create("host", memory="256M", pids=64, config=ncfg, network="egress"))
        made.append(Workspace.create("host", memory="256M", pids=64, config=ncfg, network="egress",
                                     allow=[internet.subnet]))
        made.append(Workspace.create("host", memory="256M", pids=64, config=ncfg))
        yield made
    finally:
        for w in made:
            w.remove()
        assert own_leftovers(ncfg) == {}


def test_egress_reaches_the_internet_through_nat(pair, internet):
    ws, _, _ = pair
    assert fetch(ws, internet.url("/files/hello.txt")) == "hello from the test internet"
    assert fetch(ws, internet.url("/whoami")) == internet.host_addr  # masqueraded behind the host's link
    route = ws.exec(["cat", "/proc/net/route"]).stdout
    assert any(line.split()[1] == "00000000" for line in route.splitlines()[1:])  # a default route


def test_none_has_no_route(pair, internet):
    *_, closed = pair
    assert closed.network_address() is None
    assert probe(closed, f"{internet.web}:80") == {f"{internet.web}:80": "ENETUNREACH"}


def test_always_denied_addresses_are_refused(pair, canaries):
    ws, _, _ = pair
    got = probe(ws, *(f"{a}:{CANARY_PORT}" for a in canaries))
    assert all(v != "ok" for v in got.values()), got


@pytest.fixture
def host_listener():
    """A TCP canary on every host address, on a free port."""
    srv = socket.create_server(("0.0.0.0", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


def test_host_addresses_are_refused(pair, internet, host_listener):
    ws, _, _ = pair
    gateway = str(slot_of(ws).gateway.ip)
    host_ips = {internet.host_addr, gateway, *_host_ipv4()}
    with socket.create_connection((internet.host_addr, host_listener), timeout=3):
        pass  # the host itself reaches the canary
    got = probe(ws, *(f"{a}:{host_listener}" for a in host_ips))
    assert all(v != "ok" for v in got.values()), got


def _host_ipv4() -> list[str]:
    out = subprocess.run(["ip", "-4", "-j", "addr"], capture_output=True, text=True, check=True).stdout
    return [a["local"] for link in json.loads(out) for a in link.get("addr_info", [])
            if not a["local"].startswith("127.")]


def slot_of(ws: Workspace) -> slots.Slot:
    with Store.open(ws.config.db_path) as store:
        slot = attach.slot_of(ws.config, store, ws.id)
    assert slot is not None
    return slot


def test_one_workspace_cannot_reach_another(pair):
    ws, other, _ = pair
    addr = other.network_address()
    assert addr is not None and addr != ws.network_address()
    other.commands.spawn(["python3", "-c", "import socket,time; s=socket.create_server(('0.0.0.0', 8099)); "
                                           "s.listen(); time.sleep(60)"])
    assert _eventually(lambda: probe(other, f"{addr}:8099")[f"{addr}:8099"] == "ok")  # it listens
    assert probe(ws, f"{addr}:8099")[f"{addr}:8099"] != "ok"


def _eventually(check, tries: int = 50) -> bool:
    import time

    for _ in range(tries):
        if check():
            return True
        time.sleep(0.1)
    return False


def test_allow_list_and_policy_change_on_a_running_workspace(pair, internet, canaries):
    _, restricted, _ = pair
    assert fetch(restricted, internet.url("/files/hello.txt")) == "hello from the test internet"
    restricted.set_network_policy(deny=[f"{internet.other}/32"], allow=[internet.subnet])
    got = probe(restricted, f"{internet.web}:80", f"{internet.other}:80")
    assert got == {f"{internet.web}:80": "ok", f"{internet.other}:80": got[f"{internet.other}:80"]}
    assert got[f"{internet.other}:80"] != "ok"
    restricted.set_network_policy(allow=["192.0.2.0/24"])  # the internet's subnet no longer allowed
    assert probe(restricted, f"{internet.web}:80")[f"{internet.web}:80"] != "ok"
    restricted.set_network_policy(allow=[internet.subnet])
    assert probe(restricted, f"{internet.web}:80")[f"{internet.web}:80"] == "ok"
    assert restricted.network_policy().allow_cidrs == (internet.subnet,)


def test_bad_input_is_refused_and_leaks_nothing(cfg, pair):
    *_, closed = pair
    with pytest.raises(InvalidArgument):
        Workspace.create("host", config=cfg, network="wifi")
    with pytest.raises(InvalidArgument):
        Workspace.create("host", config=cfg, allow=["203.0.113.0/24"])  # rules without egress
    with pytest.raises(InvalidArgument):
        Workspace.create("host", config=cfg, network="egress", allow=["not a name!"])
    with pytest.raises(StateConflict):
        closed.set_network_policy(allow=["203.0.113.0/24"])
    with Store.open(cfg.db_path) as store:
        assert len(slots.held(store)) == 2  # the pair's two, nothing of the refused ones


def test_gc_removes_a_crashed_workspaces_link_and_table(cfg, pair):
    """A slot whose workspace and maker are gone: gc frees it and removes its link and table."""
    from bunshin.runtime.upkeep import gc

    with Store.open(cfg.db_path) as store:
        slot = slots.reserve(cfg, store, "ws-gone", Policy())
        store.update_object(slots.KIND, str(slot.index),
                            lambda d: json.dumps({**json.loads(d), "pid": _dead_pid()}))
    holder = subprocess.Popen(["unshare", "-n", "sleep", "30"])
    try:
        assert _eventually(lambda: os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"))
        egress.attach(cfg, slot, holder.pid, Policy())
        assert slot.link in os.listdir("/sys/class/net")
        with Store.open(cfg.db_path) as store:
            report = gc.collect(cfg, store)
    finally:
        holder.kill()
        holder.wait()
    assert set(report.network) >= {slot.link, slot.table}
    assert slot.link not in os.listdir("/sys/class/net")
    with Store.open(cfg.db_path) as store:
        assert slot.index not in slots.held(store)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid



DOWNLOAD = textwrap.dedent("""
    import socket, sys, time
    host, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    def log(text):
        with open(out, "a") as f:
            f.write(text + "\\n")
    s = socket.create_connection((host, 80), timeout=30)
    s.sendall(f"GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n".encode())
    got, started = 0, False
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += len(chunk)
            if got > 100000 and not started:
                started = True
                log("started")
        log(f"done {got}")
    except OSError as e:
        log(f"error {type(e).__name__}")
        for _ in range(40):  # the clone's own link comes right after the reset
            try:
                again = socket.create_connection((host, 80), timeout=2)
                break
            except OSError:
                time.sleep(0.25)
        again.sendall(f"GET /files/hello.txt HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n".encode())
        reply = b""
        while chunk := again.recv(65536):
            reply += chunk
        log("reconnected " + reply.decode().split("\\r\\n\\r\\n", 1)[-1].strip())
""")


def _lines(ws: Workspace, path: str) -> list[str]:
    r = ws.exec(["cat", path])
    return r.stdout.splitlines() if r.exit_code == 0 else []


def test_fork_mid_download_resets_the_clones_and_they_get_their_own_address(ncfg, internet):
    """The parent finishes its download; each clone's copy of the connection is reset (the
    server sees one client) and it connects again from its own address."""
    size, path = 3_000_000, "/slow/3000000?rate=524288"
    with Workspace.create("host", memory="256M", pids=64, config=ncfg, network="egress",
                          allow=[internet.subnet]) as parent:
        parent.files.write("/tmp/dl.py", DOWNLOAD.encode())
        parent.commands.spawn(["python3", "/tmp/dl.py", internet.web, path, "/tmp/log"])
        assert _eventually(lambda: "started" in _lines(parent, "/tmp/log"), tries=100)
        clones = parent.fork(2)
        try:
            addrs = {parent.network_address(), *(c.network_address() for c in clones)}
            assert len(addrs) == 3 and None not in addrs
            for c in clones:
                assert c.network_policy() == parent.network_policy()
                assert _eventually(lambda c=c: any(ln.startswith("reconnected") for ln in _lines(c, "/tmp/log")),
                                   tries=100), _lines(c, "/tmp/log")
                log = _lines(c, "/tmp/log")
                # the kernel's abort of the socket (SOCK_DESTROY): ECONNABORTED
                assert log[1] == "error ConnectionAbortedError" and log[2] == "reconnected hello from the test internet"
            assert _eventually(lambda: any(ln.startswith("done") for ln in _lines(parent, "/tmp/log")), tries=150)
            assert _lines(parent, "/tmp/log") == ["started", _lines(parent, "/tmp/log")[-1]]
            assert int(_lines(parent, "/tmp/log")[-1].split()[1]) > size  # the body and its headers
            # a clone's policy changes alone
            clones[0].set_network_policy(allow=["192.0.2.0/24"])
            assert probe(clones[0], f"{internet.web}:80")[f"{internet.web}:80"] != "ok"
            assert probe(clones[1], f"{internet.web}:80")[f"{internet.web}:80"] == "ok"
            assert parent.network_policy().allow_cidrs == (internet.subnet,)
        finally:
            for c in clones:
                c.remove()
    served = [e for e in internet.requests() if e["path"] == path]
    assert served[-1]["sent"] == size and served[-1]["error"] is None  # the parent's, whole



HOLD = textwrap.dedent("""
    import socket, sys
    held, out = [], []
    for _ in range(int(sys.argv[2])):
        try:
            held.append(socket.create_connection((sys.argv[1], 80), timeout=3))
            out.append("ok")
        except OSError as e:
            out.append(type(e).__name__)
    print(" ".join(out))
""")


def test_connection_cap_holds(pair, internet):
    """``Limits.max_connections``: the connections beyond the cap are refused while the
    others are open, and the cap is set on a running workspace."""
    from bunshin.runtime.net.policy import Limits

    _, restricted, _ = pair
    restricted.set_network_policy(allow=[internet.subnet], limits=Limits(max_connections=2))
    try:
        r = restricted.exec(["python3", "-c", HOLD, internet.web, "3"], timeout=30)
        assert r.stdout.split() == ["ok", "ok", r.stdout.split()[2]] and r.stdout.split()[2] != "ok", r.stdout
    finally:
        restricted.set_network_policy(allow=[internet.subnet])
    assert restricted.exec(["python3", "-c", HOLD, internet.web, "3"], timeout=30).stdout.split() == ["ok"] * 3


RESOLVE = "import socket, sys\ntry:\n    print(socket.gethostbyname(sys.argv[1]))\nexcept OSError as e:\n    print(type(e).__name__)"


def test_names_allowed_answered_and_admitted_denied_refused(pair, internet):
    """allow by name: the name resolves (through the host's resolver) and its address is
    let through; another name is refused in DNS, and its address is refused too."""
    _, restricted, _ = pair
    restricted.set_network_policy(allow=["web.inet.test"])
    try:
        assert restricted.exec(["python3", "-c", RESOLVE, "web.inet.test"]).stdout.strip() == internet.web
        assert fetch(restricted, "http://web.inet.test/files/hello.txt") == "hello from the test internet"
        assert restricted.exec(["python3", "-c", RESOLVE, "other.inet.test"]).stdout.strip() == "gaierror"
        assert probe(restricted, f"{internet.other}:80")[f"{internet.other}:80"] != "ok"
        assert {"web.inet.test"} <= {q["name"].rstrip(".") for q in internet.dns_queries()}
        assert "other.inet.test" not in {q["name"].rstrip(".") for q in internet.dns_queries()}  # never asked
    finally:
        restricted.set_network_policy(allow=[internet.subnet])


def test_a_name_does_not_open_always_denied_addresses_without_an_allow_rule(pair, internet, canaries):
    """With no allow rule every name is answered, but a name the workload picked that
    answers metadata or a private address (DNS rebinding) does not admit them."""
    ws, _, _ = pair
    internet.add_name("rebind.evil.test", *canaries)
    try:
        assert ws.exec(["python3", "-c", RESOLVE, "rebind.evil.test"]).stdout.strip() in canaries
        got = probe(ws, *(f"{a}:{CANARY_PORT}" for a in canaries))
        assert all(v != "ok" for v in got.values()), got
    finally:
        internet.add_name("rebind.evil.test")


def test_a_policy_change_that_drops_a_name_drops_the_addresses_it_admitted(pair, internet):
    """An address the resolver admitted for an allowed name stays reachable while every
    allowed name still is (a wider policy), and goes when the name is no longer allowed,
    not an hour later when its admission runs out."""
    _, restricted, _ = pair
    web = f"{internet.web}:80"
    restricted.set_network_policy(allow=["web.inet.test"])
    try:
        assert fetch(restricted, "http://web.inet.test/files/hello.txt") == "hello from the test internet"
        restricted.set_network_policy(allow=["web.inet.test", "other.inet.test"])
        assert probe(restricted, web)[web] == "ok"  # not resolved again: kept
        restricted.set_network_policy(allow=["other.inet.test"])
        assert probe(restricted, web)[web] != "ok"
    finally:
        restricted.set_network_policy(allow=[internet.subnet])
