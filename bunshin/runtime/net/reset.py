"""A clone's connections to the outside, reset before its link exists.

A fork dumps every TCP connection of the parent and CRIU repairs each in every clone
(same sequence numbers, same queues: ``netns_image``). A connection to a peer outside
the workspace belongs to the parent: a clone that kept it would send the parent's
bytes again to that peer. So a clone's connections whose peer is not loopback are
destroyed (``SOCK_DESTROY`` over sock_diag, what ``ss -K`` sends; the kernel's
``tcp_abort``: the socket's owner reads ECONNRESET and may connect again) by a thread
in the clone's network namespace, before the clone's link is made: the reset the
kernel sends has no route then, and later the clone's own address would not match the
socket's (its table drops any other source). Loopback connections inside are kept.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct

from .rtnl import Rtnl

LO_INDEX = 1
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY, SOCK_DESTROY = 20, 21
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
TCP_LISTEN, TCP_CLOSE = 10, 7
ALL_STATES = 0xFFFFFFFF & ~((1 << TCP_LISTEN) | (1 << TCP_CLOSE))
_REQ = struct.Struct("=BBBxI48s")  # inet_diag_req_v2: family, protocol, ext, states, id
_ID = struct.Struct("=HH16s16sI8s")  # inet_diag_sockid: ports, addresses, interface, cookie


def _send(sock: socket.socket, kind: int, flags: int, body: bytes, seq: int) -> None:
    sock.send(struct.pack("=LHHLL", 16 + len(body), kind, NLM_F_REQUEST | flags, seq, 0) + body)


def _outside(family: int, raw: bytes) -> bool:
    addr = ipaddress.ip_address(raw[:4] if family == socket.AF_INET else raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not addr.is_loopback


def _connections(sock: socket.socket, family: int) -> list[bytes]:
    """The ids (``inet_diag_sockid``) of the TCP sockets of ``family`` not listening nor
    closed whose peer is outside."""
    _send(sock, SOCK_DIAG_BY_FAMILY, NLM_F_DUMP, _REQ.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES, b""), 1)
    out: list[bytes] = []
    while True:
        data = sock.recv(1 << 16)
        off = 0
        while off + 16 <= len(data):
            size, kind = struct.unpack_from("=LH", data, off)
            if kind == NLMSG_DONE:
                return out
            if kind == NLMSG_ERROR:
                err = struct.unpack_from("=i", data, off + 16)[0]
                raise OSError(-err, os.strerror(-err))
            sock_id = data[off + 20: off + 20 + _ID.size]  # after the header and family/state/timer/retrans
            if _outside(family, _ID.unpack(sock_id)[3]):
                out.append(sock_id)
            off += (size + 3) & ~3


def _destroy(sock: socket.socket, family: int, sock_id: bytes) -> None:
    _send(sock, SOCK_DESTROY, NLM_F_ACK, _REQ.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES, sock_id), 2)
    data = sock.recv(1 << 16)
    err = struct.unpack_from("=i", data, 16)[0] if struct.unpack_from("=H", data, 4)[0] == NLMSG_ERROR else 0
    if err and -err != 2:  # ENOENT: it closed meanwhile
        raise OSError(-err, os.strerror(-err))


def reset_outside() -> int:
    """In the caller's network namespace: destroy every TCP connection whose peer is not
    loopback, then remove their local IPv4 addresses from ``lo`` (the restore put the
    parent's there: ``criu.netns_image.ifaddr_image``); how many connections."""
    local: set[ipaddress.IPv4Address] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        for family in (socket.AF_INET, socket.AF_INET6):
            for sock_id in _connections(sock, family):
                _destroy(sock, family, sock_id)
                src = ipaddress.ip_address(_ID.unpack(sock_id)[2][:4] if family == socket.AF_INET
                                           else _ID.unpack(sock_id)[2])
                if isinstance(src, ipaddress.IPv6Address):
                    src = src.ipv4_mapped or src
                if isinstance(src, ipaddress.IPv4Address):
                    local.add(src)
    with Rtnl.open() as rt:
        for addr in local:
            try:
                rt.delete_address(LO_INDEX, ipaddress.IPv4Interface(f"{addr}/32"))
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
    return len(local)
