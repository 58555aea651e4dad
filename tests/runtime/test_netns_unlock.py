"""A dump locks the connections it reads; a restored clone's loopback carries traffic, or its restore fails by name.

CRIU ignores a failed "Unlock network" and reports success; its lock (a table that drops
every packet but its own) would then stall every connection of the clone. These tests
make a network namespace of their own, shut its loopback the way the lock does, and
run what a restore runs after CRIU (``netns_image.restored``).
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator

import pytest

from bunshin.errors import RuntimeFailure
from bunshin.runtime.criu import netns_image
from bunshin.runtime.criu.netns_image import in_netns
from bunshin.runtime.net import nft

pytestmark = pytest.mark.integration


def _drop_all(name: str) -> str:
    return (f"table inet {name} {{\n chain input {{ type filter hook input priority 0; policy drop; }}\n"
            " chain output { type filter hook output priority 0; policy drop; }\n}\n")


@pytest.fixture
def netns() -> Iterator[int]:
    """A process in a network namespace of its own, lo up; the namespace goes with it."""
    p = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && echo up && exec sleep 120"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        yield p.pid
    finally:
        p.kill()
        p.wait(10)


def _tables() -> list[str]:
    return nft.tables("", here=True)


def _port_start() -> str:
    with open("/proc/sys/net/ipv4/ip_unprivileged_port_start") as f:  # the reading thread's namespace
        return f.read().strip()


def test_a_lock_criu_left_is_lifted_and_the_loopback_flows(netns: int, caplog) -> None:
    in_netns(netns, nft.run_here, netns_image.lock_table("0123456789abcdef0123456789"))  # what CRIU restores
    assert not in_netns(netns, netns_image.loopback_flows, 0.2)  # shut, as a left lock shuts it
    with caplog.at_level(logging.WARNING, logger=netns_image.__name__):
        netns_image.restored(netns)
    assert in_netns(netns, netns_image.loopback_flows, 2.0)
    assert in_netns(netns, _tables) == []
    assert any("left its network lock" in r.getMessage() for r in caplog.records)


def test_a_loopback_shut_by_anything_else_fails_the_restore_and_touches_nothing(netns: int, monkeypatch) -> None:
    monkeypatch.setattr(netns_image, "PROBE_S", 0.3)
    in_netns(netns, nft.run_here, _drop_all("other"))
    with pytest.raises(RuntimeFailure, match=rf"loopback of restored process {netns} carries no TCP handshake"):
        netns_image.restored(netns)
    assert in_netns(netns, _tables) == ["other"]  # not a lock of CRIU's: left as it is


def test_an_open_loopback_is_left_as_it_is(netns: int, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=netns_image.__name__):
        netns_image.restored(netns)
    assert in_netns(netns, _tables) == []
    assert not caplog.records
    assert in_netns(netns, _port_start) == netns_image.UNPRIVILEGED_PORT_START


PAIR = ("import socket, sys; l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1); "
        "c = socket.create_connection(l.getsockname()); s, _ = l.accept(); print('up', flush=True); sys.stdin.read()")
LISTENER = ("import socket, sys; l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1); "
            "print('up', flush=True); sys.stdin.read()")


@pytest.mark.parametrize(("program", "lock"), [(None, netns_image.NO_LOCK), (LISTENER, netns_image.NO_LOCK),
                                               (PAIR, netns_image.CONNECTION_LOCK)])
def test_a_dump_locks_the_connections_of_a_namespace_that_holds_one(netns: int, program, lock) -> None:
    held = None
    if program is not None:  # the program in the namespace of the fixture's process
        held = subprocess.Popen(["nsenter", "-t", str(netns), "-n", "python3", "-c", program],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert held.stdout is not None and held.stdout.readline().strip() == "up"
    try:
        assert netns_image.dump_lock(netns) == lock
    finally:
        if held is not None:
            held.kill()
            held.wait(10)


def test_a_namespace_a_dump_left_locked_is_opened_again(netns: int, monkeypatch) -> None:
    monkeypatch.setattr(netns_image, "PROBE_S", 0.3)
    in_netns(netns, nft.run_here, netns_image.lock_table("fedcba9876543210fedcba98"))  # as CRIU's unlock would leave it
    netns_image.unlocked(netns)
    assert in_netns(netns, netns_image.loopback_flows, 2.0)
    assert in_netns(netns, _tables) == []
