"""The few rtnetlink requests a workspace's link needs, on a plain ``AF_NETLINK`` socket.

A veth pair made in one request with its peer created straight in the workspace's
network namespace (``VETH_INFO_PEER`` with ``IFLA_NET_NS_FD``), an address, a link
up, a default route, a link removed. Each is one message and its ack: the kernel
makes a veth pair in ~0.5 ms (its removal waits for RCU grace periods: 12-27 ms
here, off every hot path). pyroute2 0.9 was measured for the same four host-side
steps at 20-40 ms (its asyncio core, at load ~9 on two cores): a clone's restore
costs 20-45 ms, so its link must cost a fraction of one. A netlink socket works
in the network namespace it was made in: requests for a workspace's side are made
on a socket opened by a thread that joined that namespace (``in_netns``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

from ..kernel import syscalls as sc

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_DELADDR, RTM_NEWROUTE = 16, 17, 20, 21, 24
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x100, 0x200, 0x400
IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_FD = 3, 18, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_GATEWAY, RTA_OIF = 5, 4
RT_TABLE_MAIN, RTPROT_STATIC, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 4, 0, 1
IFF_UP = 0x1
_IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_T = TypeVar("_T")


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _name(text: str) -> bytes:
    return text.encode() + b"\0"


class Rtnl:
    """One rtnetlink socket of the caller's network namespace (at the time of ``open``)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._seq = 0

    @classmethod
    def open(cls) -> Rtnl:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
        sock.bind((0, 0))
        return cls(sock)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, kind: int, flags: int, body: bytes) -> None:
        """Send one request and wait for its ack; OSError with the kernel's errno."""
        self.batch([(kind, flags, body)])

    def batch(self, requests: list[tuple[int, int, bytes]]) -> None:
        """Send ``requests`` (type, flags, body) in one ``send`` and wait for every ack: the
        kernel runs them in order; the first refusal raises (OSError with its errno).
        One send and one wait instead of one each: every socket call lets another thread
        take the GIL, and getting it back can wait a switch interval (5 ms)."""
        msg, first = b"", self._seq + 1
        for kind, flags, body in requests:
            self._seq += 1
            msg += struct.pack("=LHHLL", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, self._seq, 0) + body
        self._sock.send(msg)
        pending = set(range(first, self._seq + 1))
        while pending:
            data = self._sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                size, mtype, _, seq, _ = struct.unpack_from("=LHHLL", data, off)
                if mtype == NLMSG_ERROR and seq in pending:
                    err = struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        raise OSError(-err, os.strerror(-err))
                    pending.discard(seq)
                off += max((size + 3) & ~3, 16)

    def add_veth(self, name: str, peer: str, peer_netns_fd: int) -> None:
        """A veth pair: ``name`` here, ``peer`` made in the namespace of ``peer_netns_fd``.
        EEXIST if a link ``name`` exists."""
        peer_info = _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, _name(peer)) \
            + _attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd))
        info = _attr(IFLA_INFO_KIND, b"veth") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer_info))
        body = _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, _name(name)) + _attr(IFLA_LINKINFO, info)
        self._request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)

    def delete_link(self, name: str) -> None:
        """Remove the link ``name`` (a veth takes its peer with it); ENODEV if there is none."""
        self._request(RTM_DELLINK, 0, _IFINFO.pack(0, 0, 0, 0, 0) + _attr(IFLA_IFNAME, _name(name)))

    def set_up(self, index: int) -> None:
        self.batch([up_request(index)])

    def add_address(self, index: int, iface: ipaddress.IPv4Interface) -> None:
        self.batch([address_request(index, iface)])

    def delete_address(self, index: int, iface: ipaddress.IPv4Interface) -> None:
        """EADDRNOTAVAIL if the link has no such address."""
        packed = iface.ip.packed
        body = struct.pack("=BBBBI", socket.AF_INET, iface.network.prefixlen, 0, 0, index) \
            + _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed)
        self._request(RTM_DELADDR, 0, body)

    def add_default_route(self, index: int, gateway: ipaddress.IPv4Address) -> None:
        self.batch([default_route_request(index, gateway)])


def up_request(index: int) -> tuple[int, int, bytes]:
    return RTM_NEWLINK, 0, _IFINFO.pack(socket.AF_UNSPEC, 0, index, IFF_UP, IFF_UP)


def address_request(index: int, iface: ipaddress.IPv4Interface) -> tuple[int, int, bytes]:
    packed = iface.ip.packed
    body = struct.pack("=BBBBI", socket.AF_INET, iface.network.prefixlen, 0, RT_SCOPE_UNIVERSE, index) \
        + _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed)
    return RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body


def default_route_request(index: int, gateway: ipaddress.IPv4Address) -> tuple[int, int, bytes]:
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_STATIC,
                       RT_SCOPE_UNIVERSE, RTN_UNICAST, 0) + _attr(RTA_GATEWAY, gateway.packed) \
        + _attr(RTA_OIF, struct.pack("=I", index))
    return RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body  # a restore's route through lo replaced


def open_in(netns_fd: int, peer: str) -> tuple[Rtnl, int]:
    """An rtnetlink socket of the network namespace ``netns_fd`` and the index of its link
    ``peer``, made by the calling thread after it joined that namespace and before it
    went back to its own (no thread of its own: ``in_netns`` costs a thread start and
    its GIL hand-offs)."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        sc.setns(netns_fd, sc.CLONE_NEWNET)
        try:
            rt = Rtnl.open()
            try:
                return rt, socket.if_nametoindex(peer)
            except BaseException:
                rt.close()
                raise
        finally:
            sc.setns(home, sc.CLONE_NEWNET)
    finally:
        os.close(home)


def in_netns(netns_fd: int, work: Callable[[], _T]) -> _T:
    """``work()`` run by a thread of this process that joined the network namespace
    ``netns_fd`` (the rest of the process stays where it is); its result or its error."""
    out: list[_T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            sc.setns(netns_fd, sc.CLONE_NEWNET)
            out.append(work())
        except BaseException as e:  # handed to the caller
            failed.append(e)

    t = threading.Thread(target=run, name="bunshin-netns")
    t.start()
    t.join()
    if failed:
        raise failed[0]
    return out[0]
