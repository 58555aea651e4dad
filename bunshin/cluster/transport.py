"""How the head's clients reach the hosts: TCP keepalive and a user timeout on every connection.

A call waiting for its answer sends nothing, so a host cut off (or gone and serving
again in its next epoch) would leave its thread blocked until the client's timeout
(minutes). With keepalive probes every ``KEEPALIVE_INTERVAL_S`` after
``KEEPALIVE_IDLE_S`` of quiet, a peer that does not answer ``KEEPALIVE_COUNT`` of them
(or answers with a reset) ends the call with a transport error within seconds. Data
sent but never acknowledged (the request itself went into the cut) is retransmitted
by the kernel for up to ~15 minutes; ``USER_TIMEOUT_S`` ends that sooner. A live host's
kernel answers probes and acknowledges data however busy the host is, so a long call
is never cut short.
"""

from __future__ import annotations

import socket

import httpx

KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
USER_TIMEOUT_S = 15


def keepalive_transport() -> httpx.HTTPTransport:
    return httpx.HTTPTransport(socket_options=[
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT),
        (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_S * 1000),
    ])
