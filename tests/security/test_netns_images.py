"""A snapshot's network namespace images: what ``netns_image.add`` writes is all a
loaded snapshot may bring (a restore makes the namespace they describe: links,
addresses, routes and nft rules, run as CRIU), and a dump gets it once."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime.criu import netns_image
from bunshin.runtime.memfile import criu_images
from bunshin.runtime.snapshot import image_policy
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]


PAIR = ("import socket, time; l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen(1); "
        "c = socket.create_connection(l.getsockname()); s, _ = l.accept(); open('/tmp/ready', 'w').close(); "
        "time.sleep(600)")


def _wait_for(ws, path: str) -> None:
    deadline = time.monotonic() + 30
    while ws.exec(["test", "-e", path]).exit_code != 0:
        assert time.monotonic() < deadline, path
        time.sleep(0.05)


@pytest.fixture
def images(no_leaks, tmp_path):
    """A copy of the images of a real snapshot of a workspace holding a TCP connection."""
    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        ws.commands.spawn(["python3", "-c", PAIR])
        _wait_for(ws, "/tmp/ready")
        snap = ws.snapshot()
        try:
            out = tmp_path / "images"
            shutil.copytree(snap.record.images, out)
            yield out
        finally:
            snap.remove()
    finally:
        ws.remove()


def _net(images: Path) -> int:
    return netns_image.tree_netns(images)


def test_a_dump_restores_its_own_namespace_with_lo_the_ping_range_and_the_lock(images, no_leaks):
    net = _net(images)
    inv = criu_images.load(images / "inventory.img")["entries"][0]
    assert inv["root_ids"]["net_ns_id"] != net  # criu's namespace is not the tree's: CRIU makes it
    assert inv["network_lock_method"] == netns_image.NETWORK_LOCK_NFTABLES
    (lo,) = criu_images.load(images / f"netdev-{net}.img")["entries"]
    assert lo["name"] == "lo" and lo["flags"] & 1  # up
    lock = (images / f"nftables-{net}.img").read_text()
    assert f"table inet CRIU-{inv['dump_criu_run_id'][:21]} " in lock and lock.count("policy drop") == 2
    assert netns_image.add(images, no_leaks.id_count) == net  # a second add changes nothing
    assert criu_images.load(images / "inventory.img")["entries"][0] == inv
    image_policy.check(images, no_leaks)


def test_a_dump_without_connections_gets_no_namespace(no_leaks):
    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        snap = ws.snapshot()
        try:
            images = Path(snap.record.images)
            assert not netns_image.has_connections(images)
            assert not [p for p in images.iterdir() if netns_image.NET_IMAGE.fullmatch(p.name)]
            inv = criu_images.load(images / "inventory.img")["entries"][0]
            assert inv["root_ids"]["net_ns_id"] == _net(images)  # restored in criu's, as before
        finally:
            snap.remove()
    finally:
        ws.remove()


def test_a_link_of_its_own_is_refused(images, no_leaks):
    path = images / f"netdev-{_net(images)}.img"
    img = criu_images.load(path)
    img["entries"].append({**img["entries"][0], "type": "VETH", "ifindex": 2, "name": "eth0"})
    criu_images.save(img, path)
    with pytest.raises(InvalidArgument, match="network namespace of their own"):
        image_policy.check(images, no_leaks)


def test_rules_of_its_own_are_refused(images, no_leaks):
    path = images / f"nftables-{_net(images)}.img"
    path.write_text(path.read_text() + "table inet evil { chain c { type filter hook input priority 0; } }\n")
    with pytest.raises(InvalidArgument, match=r"\(nftables-"):
        image_policy.check(images, no_leaks)


@pytest.mark.parametrize("name", ["ifaddr", "route", "iptables"])
def test_an_image_add_never_writes_is_refused(images, no_leaks, name):
    (images / f"{name}-{_net(images)}.img").write_bytes(b"\x00" * 16)
    with pytest.raises(InvalidArgument, match=f"{name}-"):
        image_policy.check(images, no_leaks)


def test_the_lock_may_be_left_out_but_a_wider_ping_range_is_refused(images, no_leaks):
    (images / f"nftables-{_net(images)}.img").unlink()
    image_policy.check(images, no_leaks)  # allowed: CRIU then restores without its lock
    path = images / f"netns-{_net(images)}.img"
    img = criu_images.load(path)
    img["entries"][0]["ipv4_sysctl"][0]["sarg"] = "0\t2147483647"
    criu_images.save(img, path)
    with pytest.raises(InvalidArgument, match="netns-"):
        image_policy.check(images, no_leaks)
