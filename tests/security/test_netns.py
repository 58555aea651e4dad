"""Attacks from inside a workspace (and a live clone of one) on the network stack.

A workspace's network namespace is its user namespace's (so CRIU can repair TCP
connections in a clone's), and every process inside has lost CAP_NET_ADMIN and
CAP_NET_RAW from its bounding set. So nothing inside may reach nf_tables, tc, link
creation, raw sockets or the namespace's sysctls: each attempt is refused, the
workspace's own namespace keeps its one link and no table, and the host's ruleset
and links (the canary) are what they were.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time

import pytest

from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]

NET_ADMIN, NET_RAW = 12, 13
PAIR = ("import socket, time; l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1); "
        "c = socket.create_connection(l.getsockname()); s, _ = l.accept(); "
        "open('/tmp/pair.ready', 'w').close(); time.sleep(3600)")
NS_GET_USERNS = 0xB701  # _IO(0xb7, 0x1): the user namespace that owns a namespace
ATTACKS = {
    "nft": "nft add table inet bunshin_evil && nft add chain inet bunshin_evil c '{ type filter hook output priority 0; }'",
    "ip link": "ip link add bunshin_evil type dummy",
    "ip addr": "ip addr add 10.66.0.1/24 dev lo",
    "tc": "tc qdisc add dev lo root netem delay 100ms",
    "sysctl": "sysctl -w net.ipv4.ip_forward=$((1 - $(cat /proc/sys/net/ipv4/ip_forward)))",
    "sysctl file": "echo $((1 - $(cat /proc/sys/net/ipv4/ip_forward))) > /proc/sys/net/ipv4/ip_forward",
    "raw socket": "python3 -c 'import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)'",
    "packet socket": "python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)'",
    "link down": "ip link set lo down",
}


def _host(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _host_tables() -> list[str]:
    """The host's nf_tables tables and chains (its rules' counters move on their own)."""
    return sorted(ln.strip() for ln in _host(["nft", "list", "ruleset"]).splitlines()
                  if ln.strip().startswith(("table ", "chain ")))


def _host_links() -> list[str]:
    return sorted(ln.split()[1] for ln in _host(["ip", "-o", "link"]).splitlines())


def _in_netns(ws: Workspace, cmd: list[str]) -> str:
    return _host(["nsenter", "-t", str(ws.record.pid), "-n", *cmd])


@pytest.fixture(params=["parent", "clone"])
def ws(request, no_leaks):
    parent = Workspace.create("host", memory="256M", pids=128, config=no_leaks)
    made = [parent]
    try:
        # a connection held across the fork: the clone's namespace is then made by CRIU in
        # its user namespace (netns_image), the case where the restorer may repair TCP
        parent.commands.spawn(["python3", "-c", PAIR])
        deadline = time.monotonic() + 30
        while parent.exec(["test", "-e", "/tmp/pair.ready"]).exit_code != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if request.param == "clone":
            made += parent.fork(1)
        yield made[-1]
    finally:
        for w in reversed(made):
            w.remove()


def test_no_process_holds_net_admin_or_net_raw(ws):
    for line in ws.exec("grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status /proc/1/status").stdout.splitlines():
        caps = int(line.split()[-1], 16)
        assert not caps & (1 << NET_ADMIN | 1 << NET_RAW), line


def test_the_network_namespace_is_the_workspaces_own(ws):
    pid = ws.record.pid
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        owner = fcntl.ioctl(fd, NS_GET_USERNS)
    finally:
        os.close(fd)
    try:
        assert os.fstat(owner).st_ino == os.stat(f"/proc/{pid}/ns/user").st_ino
        assert os.fstat(owner).st_ino != os.stat("/proc/self/ns/user").st_ino  # not the host's
    finally:
        os.close(owner)
    assert _in_netns(ws, ["ip", "-o", "link"]).count(": lo:") == 1


def test_network_attacks_are_refused_and_change_nothing(ws):
    host_tables, host_links = _host_tables(), _host_links()
    before = _in_netns(ws, ["ip", "-o", "addr"])
    forward = ws.exec("cat /proc/sys/net/ipv4/ip_forward").stdout
    for name, cmd in ATTACKS.items():
        r = ws.exec(["sh", "-c", cmd], timeout=30)
        assert r.exit_code != 0, f"{name}: {r.stdout} {r.stderr}"
    assert ws.exec("cat /proc/sys/net/ipv4/ip_forward").stdout == forward
    assert _in_netns(ws, ["nft", "list", "ruleset"]).strip() == ""
    links = _in_netns(ws, ["ip", "-o", "link"])
    assert "bunshin_evil" not in links and links.count(": lo:") == 1 and "UP" in links
    assert _in_netns(ws, ["ip", "-o", "addr"]) == before
    assert "qdisc netem" not in _in_netns(ws, ["tc", "qdisc", "show", "dev", "lo"])
    assert _host_tables() == host_tables  # the canary: the host's own tables and links
    assert "bunshin_evil" not in _host(["nft", "list", "ruleset"])
    assert _host_links() == host_links


def test_loopback_ping_and_low_ports_still_work(ws):
    # ICMP echo sockets (ping_group_range) need no CAP_NET_RAW; port 80 needs no capability
    code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); "
            "s.sendto(b'\\x08\\x00\\xf7\\xff\\x00\\x00\\x00\\x00', ('127.0.0.1', 0)); s.settimeout(5); "
            "print(len(s.recv(64)))")
    assert ws.exec(["python3", "-c", code], timeout=30).stdout.strip() == "8"
    bind = "import socket; s = socket.socket(); s.bind(('127.0.0.1', 80)); print('bound')"
    assert ws.exec(["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "python3", "-c", bind],
                   timeout=30).stdout.strip() == "bound"
