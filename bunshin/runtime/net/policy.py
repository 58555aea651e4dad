"""A workspace's network: its mode and its egress policy, as typed records.

``none`` (the default): loopback only. ``egress``: an address, a default route and NAT to
the host's uplink, filtered in the kernel by the workspace's own nftables table:

1. addresses the host's resolver answered for a name the allow rules name (``named``
   set, each for its answer's TTL) are let through (with no allow rule, names admit nothing:
   their addresses go through the steps below);
2. then the ``deny`` CIDRs are dropped;
3. then what is always denied (``ALWAYS_DENIED``: link-local and cloud metadata,
   private ranges, the pool of workspace addresses) is dropped; the host itself and
   every address of its interfaces are local destinations, refused by the table's
   input chain but for DNS to the workspace's gateway;
4. then, if the policy allows anything (CIDRs or names), only the ``allow`` CIDRs pass;
   with no allow rule every public address passes.

A name rule is a domain name or a wildcard (``*.example.com``: its subdomains, not itself).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidArgument

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Denied unless allowed by name: link-local (cloud metadata at 169.254.169.254 and
#: fd00:ec2::254), the private ranges and carrier-grade NAT, loopback and multicast.
ALWAYS_DENIED: tuple[str, ...] = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.168.0.0/16", "224.0.0.0/3",
    "::1/128", "fc00::/7", "fe80::/10", "ff00::/8", "fd00:ec2::254/128",
)

#: Per-workspace caps (``Limits``): connections it may hold open through its NAT at once,
#: and bytes per second each way (nft ``limit rate over``: packets beyond are dropped).
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_BANDWIDTH_BYTES = 125_000_000  # 1 Gbit/s

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_HINT = "give a CIDR (203.0.113.0/24, 2001:db8::/32), an address, a domain name or *.domain"


class NetworkMode(enum.StrEnum):
    NONE = "none"
    EGRESS = "egress"

    @classmethod
    def of(cls, value: NetworkMode | str | None) -> NetworkMode:
        try:
            return cls(value or cls.NONE)
        except ValueError:
            raise InvalidArgument(f"unknown network mode {value!r}", hint="use 'none' or 'egress'") from None


def check_name(text: str) -> str:
    """A domain name or ``*.`` wildcard, lower-cased, without a trailing dot; InvalidArgument if not."""
    name = text.strip().lower().rstrip(".")
    labels = name.split(".")
    if labels and labels[0] == "*":
        labels = labels[1:]
    if len(name) > 253 or len(labels) < 1 or not all(_LABEL.match(label) for label in labels) \
            or labels[-1].isdigit():
        raise InvalidArgument(f"{text!r} is not a CIDR, an address or a domain name", hint=_HINT)
    return name


def name_matches(pattern: str, name: str) -> bool:
    """Does ``name`` (lower-case, no trailing dot) match ``pattern`` (a name or ``*.domain``)?"""
    if pattern.startswith("*."):
        return name.endswith(pattern[1:]) and name != pattern[2:]
    return name == pattern


def _split(rules: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``rules`` as (CIDRs, names), each normalised and de-duplicated in order."""
    if isinstance(rules, str):
        rules = [rules]
    cidrs: list[str] = []
    names: list[str] = []
    for rule in rules:
        if not isinstance(rule, str) or not rule.strip():
            raise InvalidArgument(f"network rule {rule!r} is not a non-empty string", hint=_HINT)
        try:
            net = str(ipaddress.ip_network(rule.strip(), strict=False))
            if net not in cidrs:
                cidrs.append(net)
        except ValueError:
            name = check_name(rule)
            if name not in names:
                names.append(name)
    return tuple(cidrs), tuple(names)


@dataclass(frozen=True)
class Limits:
    """Caps of one workspace (see the defaults above)."""

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    bandwidth_bytes: int = DEFAULT_BANDWIDTH_BYTES

    def __post_init__(self) -> None:
        for key in ("max_connections", "bandwidth_bytes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"network limit {key}={value!r} is not a positive whole number")


@dataclass(frozen=True)
class Policy:
    """Allow and deny rules of one workspace: CIDRs (checked by the kernel) and names
    (answered by the host's resolver, which admits the addresses it answered)."""

    allow_cidrs: tuple[str, ...] = ()
    allow_names: tuple[str, ...] = ()
    deny_cidrs: tuple[str, ...] = ()
    deny_names: tuple[str, ...] = ()
    limits: Limits = dataclasses.field(default_factory=Limits)

    @classmethod
    def of(cls, allow: Iterable[str] = (), deny: Iterable[str] = (), limits: Limits | None = None) -> Policy:
        (a_cidrs, a_names), (d_cidrs, d_names) = _split(allow), _split(deny)
        return cls(a_cidrs, a_names, d_cidrs, d_names, limits or Limits())

    @property
    def restricted(self) -> bool:
        """Whether only what is allowed passes (some allow rule given)."""
        return bool(self.allow_cidrs or self.allow_names)

    def allows_name(self, name: str) -> bool:
        """Whether the resolver answers ``name``: not denied by name, and allowed by name
        unless the policy allows nothing in particular."""
        name = name.lower().rstrip(".")
        if any(name_matches(p, name) for p in self.deny_names):
            return False
        return not self.restricted or any(name_matches(p, name) for p in self.allow_names)

    def keeps_names_of(self, old: Policy) -> bool:
        """Whether every name ``old`` let resolve still resolves under this policy (it allows
        each name pattern ``old`` allowed, and denies none ``old`` did not): only then may
        the addresses ``old``'s names admitted stay admitted."""
        if not old.restricted and self.restricted:
            return False  # every name resolved under ``old``, only some do now
        return set(old.allow_names) <= set(self.allow_names) and set(self.deny_names) <= set(old.deny_names)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Policy:
        return cls(tuple(d.get("allow_cidrs", ())), tuple(d.get("allow_names", ())),
                   tuple(d.get("deny_cidrs", ())), tuple(d.get("deny_names", ())), Limits(**d.get("limits", {})))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def networks(cidrs: Iterable[str], version: int) -> list[ipaddress.IPv4Network]:
    """The IPv4 CIDRs (``version`` 4) of ``cidrs``."""
    assert version == 4, "workspaces get IPv4 only"
    return [n for n in (ipaddress.ip_network(c) for c in cidrs) if isinstance(n, ipaddress.IPv4Network)]
