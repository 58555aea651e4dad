"""Units: the policy records, slot addresses and names, and the table a policy makes (no root)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import InvalidArgument
from bunshin.runtime.net import egress, resolver, slots
from bunshin.runtime.net.policy import Limits, NetworkMode, Policy, check_name, name_matches


def test_modes():
    assert NetworkMode.of(None) is NetworkMode.NONE and NetworkMode.of("egress") is NetworkMode.EGRESS
    with pytest.raises(InvalidArgument, match="unknown network mode"):
        NetworkMode.of("bridge")


def test_rules_are_normalised():
    p = Policy.of(allow=["203.0.113.7", "203.0.113.0/24", "203.0.113.0/24"], deny=["198.51.100.9/24"])
    assert p.allow_cidrs == ("203.0.113.7/32", "203.0.113.0/24") and p.deny_cidrs == ("198.51.100.0/24",)
    assert p.restricted and not Policy.of(deny=["198.51.100.0/24"]).restricted
    for bad in ("", "not a name!", "-x.com", "1.2.3.4.5"):
        with pytest.raises(InvalidArgument):
            Policy.of(allow=[bad])
    assert Policy.from_dict(p.to_dict()) == p
    named = Policy.of(allow=["*.example.com", "Example.org."], deny=["bad.example.com"])
    assert named.allow_names == ("*.example.com", "example.org") and named.restricted
    assert named.allows_name("a.example.com") and named.allows_name("example.org")
    assert not named.allows_name("bad.example.com") and not named.allows_name("example.net")
    assert Policy.of(deny=["bad.example.com"]).allows_name("anything.else")


def test_names_and_wildcards():
    assert check_name("Example.COM.") == "example.com" and check_name("*.example.com") == "*.example.com"
    assert name_matches("*.example.com", "a.b.example.com") and not name_matches("*.example.com", "example.com")
    assert not name_matches("*.example.com", "badexample.com") and name_matches("example.com", "example.com")


def test_limits_must_be_positive():
    with pytest.raises(InvalidArgument):
        Limits(max_connections=0)
    with pytest.raises(InvalidArgument):
        Limits(bandwidth_bytes=True)  # type: ignore[arg-type]


def test_slots_addresses_and_names(tmp_path: Path):
    cfg = Config.for_home(tmp_path)
    s = slots.Slot.of(cfg, slots.count(cfg) - 1)
    assert str(s.gateway) == "10.200.255.249/30" and str(s.address) == "10.200.255.250/30"
    assert len(s.link) <= 15 and s.link.startswith(slots.LINK_PREFIX + slots.tag(cfg))
    assert slots.tag(Config.for_home(tmp_path / "other")) != slots.tag(cfg)
    for bad in ("8.8.0.0/16", "10.0.0.0/30", "nonsense"):
        with pytest.raises(InvalidArgument):
            slots.pool(dataclasses.replace(cfg, net_pool=bad))


def test_table_text_orders_the_policy(tmp_path: Path):
    cfg = Config.for_home(tmp_path)
    slot = slots.Slot.of(cfg, 5)
    open_text = egress.table_text(cfg, slot, Policy.of(deny=["198.51.100.0/24"]))
    assert "!= @allow4" not in open_text and "198.51.100.0/24" in open_text
    text = egress.table_text(cfg, slot, Policy.of(allow=["203.0.113.0/24"]))
    order = [text.index(k) for k in ("@named4 jump admit", "@deny4 reject", "@always4 reject", "!= @allow4 drop")]
    assert order == sorted(order)
    # the pool is merged into 10/8 (an interval set refuses overlaps); metadata is in it
    assert "10.0.0.0/8" in text and "169.254.0.0/16" in text and "10.200.0.0/16" not in text
    assert f"ip saddr != {slot.address.ip} drop" in text and "ct count over 512" in text


def test_table_closes_the_resolvers_port_to_other_interfaces(tmp_path: Path):
    """The resolver's socket is on every address of the host: only workspaces' links reach it."""
    cfg = Config.for_home(tmp_path)
    text = egress.table_text(cfg, slots.Slot.of(cfg, 5), Policy.of())
    assert f'iifname != "bsn*" udp dport {resolver.port(cfg)} drop' in text


def test_admitted_addresses_are_kept_only_while_every_name_still_resolves() -> None:
    old = Policy.of(allow=["web.inet.test", "*.pypi.test"], deny=["bad.pypi.test"])
    assert Policy.of(allow=["web.inet.test", "*.pypi.test", "more.test"], deny=["bad.pypi.test"]).keeps_names_of(old)
    assert Policy.of(allow=["web.inet.test", "*.pypi.test"]).keeps_names_of(old)  # a deny lifted
    assert not Policy.of(allow=["*.pypi.test"], deny=["bad.pypi.test"]).keeps_names_of(old)  # a name dropped
    assert not Policy.of(allow=["web.inet.test", "*.pypi.test"],
                         deny=["bad.pypi.test", "x.pypi.test"]).keeps_names_of(old)  # a name denied
    assert not Policy.of(allow=["web.inet.test"]).keeps_names_of(Policy.of())  # from every name to some
    # with no allow rule a name admits nothing: what names admitted goes
    assert not Policy.of().keeps_names_of(Policy.of(allow=["web.inet.test"]))
