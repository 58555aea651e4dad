"""How the head's clients reach the hosts: TCP keepalive on every connection.

A call waiting for its answer sends nothing, so a host cut off (or gone and serving
again elsewhere in its next epoch) would leave its thread blocked until the client's
timeout (minutes). With keepalive probes every ``KEEPALIVE_INTERVAL_S`` after
``KEEPALIVE_IDLE_S`` of quiet, a peer that does not answer ``KEEPALIVE_COUNT`` of them
(or answers with a reset) ends the call with a transport error within seconds; a live
host's kernel answers the probes, so a long call is never cut short.
"""

from __future__ import annotations

import socket

import httpx

KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3


def keepalive_transport() -> httpx.HTTPTransport:
    return httpx.HTTPTransport(socket_options=[
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
        (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S),
        (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT),
    ])
