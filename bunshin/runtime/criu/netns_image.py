"""A dump's network namespace, put back into its images so CRIU makes it in the clone.

A dump runs inside the workspace's network namespace (``criu.Placement``): CRIU sees
the tree in its own namespace and leaves the namespace out of the images (no links,
addresses, rules or tables to dump with CRIU's ``ip`` and ``iptables-save`` runs:
~30 ms less pause). Restored tasks would then stay in the namespace criu runs in,
which the host made, where CRIU's TCP repair (``TCP_REPAIR``: CAP_NET_ADMIN over the
socket's namespace) is refused to them. ``add`` gives the inventory's ``root_ids`` (the
namespaces criu was in) a network namespace id of its own and writes the tree's
namespace as a workspace's always is (nothing inside can change it: no workspace
process keeps CAP_NET_ADMIN or CAP_NET_RAW): ``lo`` up, ``ping_group_range`` over the
workspace's groups, and CRIU's network lock. Only a dump that holds a TCP connection
(neither listening nor closed) gets them: CRIU's restore of a namespace costs ~15 ms
(it runs ``iptables-restore -V`` and ``ip6tables-restore -V`` even with no tables to
restore), and without a connection the clone's tasks stay in the namespace criu ran in,
as before. CRIU's restore then unshares the clone's
network namespace in the root task after its user namespace, so the namespace is the
user namespace's, and the restorer, which holds that namespace's capabilities until it
restores the tasks' credentials last, repairs the connections.

A restored connection's MSS: CRIU connects the socket in repair mode before it restores
its options, so the kernel sizes its segments (``tcp_connect_init``) with the default
MSS clamp (536: segments of 524 bytes instead of 65,483 on loopback), and the clamp
CRIU sets next is not applied until the path's MTU changes (``tcp_current_mss``
compares it with the one the MSS was sized for). With both windows full of 524-byte
segments the receive buffer fills long before the window (each segment's overhead is
counted) and the connection stalls; plain CRIU does the same. So ``lo`` is restored
with ``RESTORE_MTU`` and ``restored`` puts ``LO_MTU`` back: a restored connection's
first transmission finds another MTU and sizes its segments again, with the clamp.

The lock (CRIU's own table, ``inet CRIU-`` + the dump's run id) drops every packet but
CRIU's while the tasks are restored, and CRIU deletes it at "Unlock network", once all
are back: without it the end restored first sends its unsent queue to a peer not yet
restored and gets a reset. CRIU ignores a failed unlock (``network_unlock`` returns
nothing) and reports success, which would leave every connection of the clone stalled.
So ``restored`` checks that the clone's ``lo`` carries a TCP handshake; if it does not, it
deletes the lock tables still there (nothing inside can make a table) and checks again,
and a clone whose loopback stays shut fails its restore by name.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ...errors import RuntimeFailure
from ..kernel import syscalls as sc
from ..memfile.criu_images import load, save
from ..net import nft

log = logging.getLogger(__name__)
T = TypeVar("T")

# lo as a dump of a workspace's namespace records it: IFF_UP | IFF_LOOPBACK |
# IFF_RUNNING | IFF_LOWER_UP, and the loopback MTU
LO_FLAGS = 0x1 | 0x8 | 0x40 | 0x10000
LO_MTU = 65536
RESTORE_MTU = LO_MTU - 2  # lo while CRIU restores (under both families' path MTU caps): see above
SOCCR_MARK = 0xC114  # the mark of CRIU's own repair-mode packets (criu/soccr)
LOCK_ID_CHARS = 21  # "inet CRIU-" + 21 characters fill CRIU's 32-byte table name
LOCK_PREFIX = "CRIU-"
PROBE_S = 2.0  # how long a handshake over a restored clone's lo may take (~0.1 ms when it flows)
UNPRIVILEGED_PORT_START = "0"  # net.ipv4.ip_unprivileged_port_start in a workspace
IPPROTO_TCP, TCP_CLOSE, TCP_LISTEN = 6, 7, 10
NETWORK_LOCK_NFTABLES, NETWORK_LOCK_SKIP = 1, 2  # InventoryEntry.network_lock_method (criu/include/cr_options.h)
# The images CRIU keeps of one network namespace (criu/image-desc.c), by id
NET_IMAGE = re.compile(r"(?:netdev|ifaddr|route6?|rule|ip6?tables|nftables|netns|netnf-ct|netnf-exp)-(\d+)\.img")


NO_LOCK, CONNECTION_LOCK = "skip", "nftables"  # a dump's ``--network-lock``
_UNLOCKED_TCP_STATES = {"06", "07", "0A"}  # TIME_WAIT, CLOSE, LISTEN (include/net/tcp_states.h, hex)


def dump_lock(pid: int) -> str:
    """The ``--network-lock`` of a dump of the workspace whose process ``pid`` is: CRIU's
    lock of each connection (an nftables set in the workspace's namespace that drops its
    packets while CRIU reads it: a longer pause) if the namespace holds one, else
    none. A connection made after this look and before the freeze is dumped unlocked."""
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f, None)  # the header
                if any(line.split()[3] not in _UNLOCKED_TCP_STATES for line in f if line.strip()):
                    return CONNECTION_LOCK
        except FileNotFoundError:
            continue  # no IPv6 in the kernel, or the process is gone (the dump says so)
    return NO_LOCK


def lock_table(run_id: str) -> str:
    """CRIU's network lock for a restore of the dump ``run_id``, as nft commands."""
    chains = "".join(
        f"  chain {hook} {{ type filter hook {hook} priority 0; policy drop; meta mark {SOCCR_MARK:#x} accept; }}\n"
        for hook in ("output", "input"))
    return f"table inet {LOCK_PREFIX}{run_id[:LOCK_ID_CHARS]} {{\n{chains}}}\n"


def expected(net: int, run_id: str, groups: int) -> dict[str, Any]:
    """The network namespace images ``add`` writes, by file name: decoded images
    (dicts) and the lock's text."""
    return {
        f"netdev-{net}.img": {"magic": "NETDEV", "entries": [
            {"type": "LOOPBACK", "ifindex": 1, "mtu": RESTORE_MTU, "flags": LO_FLAGS, "name": "lo"}]},
        f"netns-{net}.img": {"magic": "NETNS", "entries": [
            {"ipv4_sysctl": [{"type": "CTL_STR", "sarg": f"0\t{groups - 1}"}]}]},
        f"nftables-{net}.img": lock_table(run_id),
    }


IPADD_DUMP_MAGIC = 0x47361222  # what ``ip addr save`` writes first (iproute2), CRIU's ifaddr image
ROUTE_DUMP_MAGIC = 0x45311224  # the same of ``ip route save`` (CRIU's route image)
RTM_NEWROUTE, RTA_OIF, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK, RTN_UNICAST = 24, 4, 254, 3, 253, 1
RTM_NEWADDR, IFA_ADDRESS, IFA_LOCAL, IFA_F_PERMANENT, RT_SCOPE_HOST = 20, 1, 2, 0x80, 254


def outside_addresses(images: Path) -> list[str]:
    """The local IPv4 addresses of the dump's TCP connections to a peer that is not
    loopback (connections out of a workspace with egress: ``runtime.net``)."""
    out: list[str] = []
    for e in load(images / "files.img")["entries"]:
        isk = e.get("isk") or {}
        if isk.get("proto") != IPPROTO_TCP or isk.get("state") in (TCP_CLOSE, TCP_LISTEN):
            continue
        src, dst = (_address(isk.get(k) or [0]) for k in ("src_addr", "dst_addr"))
        if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped is not None:
            src, dst = src.ipv4_mapped, getattr(dst, "ipv4_mapped", None) or dst
        if not dst.is_loopback and isinstance(src, ipaddress.IPv4Address) and str(src) not in out:
            out.append(str(src))
    return out


def _address(words: list[Any]) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of an image's socket: its 32-bit words as read off the wire (a string
    where pycriu decoded them)."""
    if isinstance(words[0], str):
        return ipaddress.ip_address(words[0])
    return ipaddress.ip_address(b"".join(struct.pack("<I", w) for w in words))


def ifaddr_image(addresses: list[str]) -> bytes:
    """``addresses`` as /32s on ``lo`` (ifindex 1), as ``ip addr save`` writes them: CRIU
    restores the clone's namespace with them (``ip addr restore``) before its sockets,
    so a connection bound to the parent's address can be repaired; ``runtime.net``
    resets those connections and removes the addresses after the restore."""
    out = struct.pack("=I", IPADD_DUMP_MAGIC)
    for addr in addresses:
        packed = ipaddress.IPv4Address(addr).packed
        attrs = struct.pack("=HH", 8, IFA_LOCAL) + packed + struct.pack("=HH", 8, IFA_ADDRESS) + packed
        body = struct.pack("=BBBBI", socket.AF_INET, 32, IFA_F_PERMANENT, RT_SCOPE_HOST, 1) + attrs
        out += struct.pack("=LHHLL", 16 + len(body), RTM_NEWADDR, 0, 0, 0) + body
    return out


def route_image() -> bytes:
    """A default route through ``lo``, as ``ip route save`` writes it: a repaired
    connection is connected again (``connect`` in repair mode), which needs a route to
    its peer; ``runtime.net`` replaces it with the clone's own once the connections to
    the outside are reset."""
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_LINK,
                       RTN_UNICAST, 0) + struct.pack("=HHI", 8, RTA_OIF, 1)
    return struct.pack("=I", ROUTE_DUMP_MAGIC) + struct.pack("=LHHLL", 16 + len(body), RTM_NEWROUTE, 0, 0, 0) + body


def has_connections(images: Path) -> bool:
    """Whether the dump holds a TCP socket that is neither listening nor closed."""
    for e in load(images / "files.img")["entries"]:
        isk = e.get("isk") or {}
        if isk.get("proto") == IPPROTO_TCP and isk.get("state") not in (TCP_CLOSE, TCP_LISTEN):
            return True
    return False


def restores_netns(images: Path) -> bool:
    """Whether a restore of ``images`` makes the clone's network namespace (``add`` wrote it)."""
    return any(images.glob("netdev-*.img"))


def tree_netns(images: Path) -> int:
    """The network namespace id of the dumped tree (one for all its tasks)."""
    nets = {int(load(p)["entries"][0]["net_ns_id"]) for p in images.glob("ids-*.img")}
    if len(nets) != 1:
        raise ValueError(f"the dump holds {len(nets)} network namespaces; a workspace has one")
    return nets.pop()


def add(images: Path, groups: int) -> int:
    """Make the dump in ``images`` restore its network namespace; returns its id.

    ``groups``: how many group ids the workspace's user namespace maps (0..groups-1).
    A dump that already has its own namespace is left as it is.
    """
    net = tree_netns(images)
    inv = load(images / "inventory.img")
    entry = inv["entries"][0]
    if entry["root_ids"]["net_ns_id"] != net:
        return net
    if not has_connections(images):  # nothing to repair: the clone's tasks stay in criu's namespace (cheaper)
        if entry.get("network_lock_method") == NETWORK_LOCK_NFTABLES:  # locked for a connection since closed
            entry["network_lock_method"] = NETWORK_LOCK_SKIP  # (else each restore makes and drops a table)
            save(inv, images / "inventory.img")
        return net
    used = [v for p in images.glob("ids-*.img") for k, v in load(p)["entries"][0].items() if k.endswith("_id")]
    entry["root_ids"]["net_ns_id"] = max([*used, *entry["root_ids"].values()]) + 1
    # a restore takes the lock method from the dump, not from its options
    entry["network_lock_method"] = NETWORK_LOCK_NFTABLES
    for name, content in expected(net, entry["dump_criu_run_id"], groups).items():
        if isinstance(content, str):
            (images / name).write_text(content)
        else:
            save(content, images / name)
    outside = outside_addresses(images)
    if outside:
        (images / f"ifaddr-{net}.img").write_bytes(ifaddr_image(outside))
        (images / f"route-{net}.img").write_bytes(route_image())
    save(inv, images / "inventory.img")  # last: a dump left half-way keeps criu's namespace
    return net


def _set_up(pid: int) -> None:
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start", "w") as f:
        f.write(UNPRIVILEGED_PORT_START)
    sc.set_mtu("lo", LO_MTU)  # restored connections size their segments again (see above)
    _open_loopback(pid)


def loopback_flows(timeout: float | None = None) -> bool:
    """A TCP handshake over ``lo`` completes in the calling thread's network namespace
    (between two sockets of its own, reset at close: no TIME_WAIT is left)."""
    with socket.socket() as lsk, socket.socket() as c:
        lsk.bind(("127.0.0.1", 0))
        lsk.listen(1)
        c.settimeout(PROBE_S if timeout is None else timeout)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            c.connect(lsk.getsockname())
        except OSError:
            return False
        return True


def _open_loopback(pid: int) -> None:
    """Check the restored namespace's loopback and lift a lock CRIU left (see the module's docstring)."""
    if loopback_flows():
        return
    left = nft.tables(LOCK_PREFIX, here=True)
    for name in left:
        nft.run_here(f"delete table inet {name}")
    if left and loopback_flows():
        log.warning("criu left its network lock (%s) in the namespace of restored process %d; removed", left, pid)
        return
    raise RuntimeFailure(f"the loopback of restored process {pid} carries no TCP handshake"
                         f"{f' (lock tables {left} removed)' if left else ''}: its connections would stall",
                         hint="`nsenter -t PID -n nft list ruleset` and `ip link` show its namespace; "
                              "the restore's CRIU log says whether it unlocked the network")


def unlocked(pid: int) -> None:
    """After a dump that locked the connections of ``pid``'s namespace: its loopback
    carries traffic again (``_open_loopback``)."""
    in_netns(pid, _open_loopback, pid)


def in_netns(pid: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of the host's that joined ``pid``'s network namespace; its result."""
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                sc.setns(fd, sc.CLONE_NEWNET)  # this thread only
            finally:
                os.close(fd)
            out.append(fn(*args))
        except BaseException as e:  # handed to the caller
            failed.append(e)

    t = threading.Thread(target=run, name="bunshin-netns")
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return out[0]


def restored(pid: int) -> None:
    """What CRIU does not carry, set in a restored clone's namespace (from a thread of
    the host's that joins it): any port to bind for every user inside, as the launcher
    sets it in a workspace's, and lo's MTU (``RESTORE_MTU`` during the restore); then
    its loopback is checked (``_open_loopback``)."""
    in_netns(pid, _set_up, pid)
