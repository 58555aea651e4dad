"""A workspace's way out: a veth pair, its addresses and route, and its nftables table.

The host's end (``Slot.link``) holds the gateway address, the workspace's end
(``eth0`` inside) the workspace's, with a default route through the gateway; the host
forwards and masquerades (NAT) what comes from it to whatever interface routes the
destination. The workspace's table (``table``) is the only place its traffic is
decided, in the kernel (nothing inside keeps CAP_NET_ADMIN over its namespace):

- prerouting: its DNS (UDP 53, whatever address it asks) goes to the home's resolver
  at its gateway (``resolver``: only allowed names, admitting the addresses answered);
- input from its link: that resolver, replies of what it opened; nothing else reaches
  the host (every address of the host's interfaces is local); the resolver's port (its
  socket is on every address) is dropped from any interface but a workspace's;
- forward from its link: its own source address only, IPv4 only, at most
  ``Limits.max_connections`` connections and ``Limits.bandwidth_bytes`` per second,
  then the policy (``policy``: named set, deny, always denied, allow);
- forward to its link: replies only (nothing outside opens a connection into it);
- postrouting: masquerade its address out of any interface but a workspace's.

The table is added before the link exists (no packet of the link is ever unfiltered)
and removed before the link. A base chain's ``accept`` does not skip the other tables'
chains at that hook, a ``drop`` is final: tables of different workspaces do not interfere.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket

from ...config import Config
from . import nft, resolver
from .policy import ALWAYS_DENIED, Policy, networks
from .rtnl import Rtnl, address_request, default_route_request, open_in, up_request
from .slots import LINK_PREFIX, PEER_NAME, TABLE_PREFIX, Slot, pool, tag

DNS_PORT = 53
GUARD_TABLE = "bunshin-guard"
FORWARD_SYSCTL = "/proc/sys/net/ipv4/ip_forward"


def _elements(nets: list[ipaddress.IPv4Network]) -> str:
    """A set's elements, overlaps merged (an interval set refuses overlapping ones)."""
    merged = [str(n) for n in ipaddress.collapse_addresses(nets)]
    return f" elements = {{ {', '.join(merged)} }};" if merged else ""


def table_text(cfg: Config, slot: Slot, policy: Policy) -> str:
    """The workspace's table, in nft syntax (``egress`` describes its chains)."""
    link, addr, gw = slot.link, slot.address.ip, slot.gateway.ip
    always = networks([*ALWAYS_DENIED, str(pool(cfg))], 4)
    lim = policy.limits
    resolver_port = resolver.port(cfg)
    rate = f"limit rate over {lim.bandwidth_bytes} bytes/second"
    restricted = f'\n    iifname "{link}" ip daddr != @allow4 drop' if policy.restricted else ""
    return f"""table inet {slot.table} {{
  set allow4 {{ type ipv4_addr; flags interval;{_elements(networks(policy.allow_cidrs, 4))} }}
  set deny4 {{ type ipv4_addr; flags interval;{_elements(networks(policy.deny_cidrs, 4))} }}
  set always4 {{ type ipv4_addr; flags interval;{_elements(always)} }}
  set named4 {{ type ipv4_addr; flags timeout; }}
  chain input {{
    type filter hook input priority 0; policy accept;
    iifname "{link}" ct state established,related accept
    iifname "{link}" ip saddr {addr} ip daddr {gw} udp dport {resolver_port} accept
    iifname != "{LINK_PREFIX}*" udp dport {resolver_port} drop
    iifname "{link}" reject with icmpx admin-prohibited
  }}
  chain forward {{
    type filter hook forward priority 0; policy accept;
    oifname "{link}" ct state established,related {rate} drop
    oifname "{link}" ct state established,related accept
    oifname "{link}" drop
    iifname "{link}" meta nfproto != ipv4 drop
    iifname "{link}" ip saddr != {addr} drop
    iifname "{link}" {rate} drop
    iifname "{link}" ct state established,related accept
    iifname "{link}" ct state != new drop
    iifname "{link}" ip daddr @named4 jump admit
    iifname "{link}" ip daddr @deny4 reject with icmpx admin-prohibited
    iifname "{link}" ip daddr @always4 reject with icmpx admin-prohibited{restricted}
    iifname "{link}" jump admit
  }}
  chain admit {{
    ct count over {lim.max_connections} reject with icmpx admin-prohibited
    accept
  }}
  chain prerouting {{
    type nat hook prerouting priority -100; policy accept;
    iifname "{link}" udp dport {DNS_PORT} dnat ip to {gw}:{resolver_port}
  }}
  chain postrouting {{
    type nat hook postrouting priority 100; policy accept;
    ip saddr {addr} oifname != "{LINK_PREFIX}*" masquerade
  }}
}}
"""


def _guard() -> None:
    """Forwarding on, and the host forwarding nothing but workspaces' traffic: a table
    that drops what neither comes from nor goes to a workspace's link (added before
    forwarding is turned on; it stays, as bunshin's tmpfs does)."""
    with open(FORWARD_SYSCTL) as f:
        if f.read().strip() == "1":
            return
    nft.run(f"""table inet {GUARD_TABLE} {{
  chain forward {{
    type filter hook forward priority 0; policy accept;
    iifname != "{LINK_PREFIX}*" oifname != "{LINK_PREFIX}*" drop
  }}
}}
""")
    with open(FORWARD_SYSCTL, "w") as f:
        f.write("1")


def add_table(cfg: Config, slot: Slot, policy: Policy) -> None:
    add_tables(cfg, [(slot, policy)])


def add_tables(cfg: Config, tables: list[tuple[Slot, Policy]]) -> None:
    """Add the tables of several slots in one transaction (~2 ms for one, little more for many)."""
    _guard()
    nft.run("".join(table_text(cfg, slot, policy) for slot, policy in tables))


def set_policy(cfg: Config, slot: Slot, policy: Policy, *, keep_named: bool) -> None:
    """Replace the table's rules and CIDR sets in one transaction; open connections stay.
    ``keep_named``: the addresses the resolver admitted for allowed names stay too (their
    TTLs run on); else they go with the rules, and a name the new policy still allows
    admits its addresses again when it is next resolved."""
    named = "" if keep_named else f"flush set inet {slot.table} named4\n"
    nft.run(f"flush table inet {slot.table}\nflush set inet {slot.table} allow4\n"
            f"flush set inet {slot.table} deny4\n{named}" + table_text(cfg, slot, policy))


def add_link(slot: Slot, netns_fd: int) -> None:
    """The veth pair, its host end addressed and up; the workspace's end (``eth0``)
    addressed and up with the default route through the gateway: two batches of
    rtnetlink requests, one on each side. OSError(EEXIST) if the link exists (another
    home's slot)."""
    with Rtnl.open() as rt:
        rt.add_veth(slot.link, PEER_NAME, netns_fd)
        index = socket.if_nametoindex(slot.link)
        rt.batch([address_request(index, slot.gateway), up_request(index)])
    inside, peer = open_in(netns_fd, PEER_NAME)
    with inside:
        inside.batch([address_request(peer, slot.address), up_request(peer),
                      default_route_request(peer, slot.gateway.ip)])


def attach(cfg: Config, slot: Slot, pid: int, policy: Policy) -> None:
    """Give the network namespace of ``pid`` its way out through ``slot``; on failure
    nothing of it is left (``detach``)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        add_table(cfg, slot, policy)
        add_link(slot, fd)
    except BaseException:
        detach(slot)
        raise
    finally:
        os.close(fd)


def detach(slot: Slot) -> None:
    """Remove the table, then the link (and its peer). Idempotent."""
    with contextlib.suppress(Exception):
        if slot.table in nft.tables(slot.table):
            nft.run(f"delete table inet {slot.table}")
    with Rtnl.open() as rt:
        try:
            rt.delete_link(slot.link)
        except OSError as e:
            if e.errno != errno.ENODEV:
                raise


def leftovers(cfg: Config, held: set[int]) -> tuple[list[str], list[str]]:
    """Links and tables of this home whose slot is not in ``held``."""
    t = tag(cfg)
    links = [n for n in os.listdir("/sys/class/net") if n.startswith(LINK_PREFIX + t)
             and _index(n[len(LINK_PREFIX) + len(t):], 16) not in held]
    tprefix = f"{TABLE_PREFIX}{t}-"
    tables = [n for n in nft.tables(tprefix) if _index(n[len(tprefix):], 10) not in held]
    return links, tables


def _index(text: str, base: int) -> int | None:
    try:
        return int(text, base)
    except ValueError:
        return None


def sweep(cfg: Config, held: set[int]) -> list[str]:
    """Remove this home's links and tables of slots not in ``held``; what was removed."""
    links, tables = leftovers(cfg, held)
    for table in tables:
        with contextlib.suppress(Exception):
            nft.run(f"delete table inet {table}")
    with Rtnl.open() as rt:
        for link in links:
            with contextlib.suppress(OSError):
                rt.delete_link(link)
    return links + tables

