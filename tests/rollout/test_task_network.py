"""Task specs with a network (``network: egress``, ``allow``, ``deny``)."""

from __future__ import annotations

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout.task import parse_task


def test_network_fields_and_their_create_arguments():
    plain = parse_task({"id": "a"})
    assert plain.network == "none" and plain.network_kwargs() == {}
    t = parse_task({"id": "a", "network": "egress", "allow": ["198.51.100.0/24", "203.0.113.7"],
                    "deny": ["203.0.113.0/24"]})
    assert t.network_kwargs() == {"network": "egress", "allow": ["198.51.100.0/24", "203.0.113.7"],
                                  "deny": ["203.0.113.0/24"]}


def test_network_changes_the_root_key_and_only_then():
    plain = parse_task({"id": "a"})
    assert parse_task({"id": "a", "network": "none"}).root_key("host") == plain.root_key("host")
    egress = parse_task({"id": "a", "network": "egress"})
    assert egress.root_key("host") != plain.root_key("host")
    assert parse_task({"id": "a", "network": "egress", "allow": ["198.51.100.0/24"]}).root_key("host") != egress.root_key("host")


@pytest.mark.parametrize(("bad", "says"), [
    ({"network": "bridge"}, "network"),
    ({"allow": ["198.51.100.0/24"]}, "need network: egress"),
    ({"network": "egress", "deny": ["not a rule"]}, "not a CIDR"),
    ({"network": "egress", "allow": "pypi.org"}, "allow"),
])
def test_bad_network_names_the_problem(bad, says):
    with pytest.raises(InvalidArgument) as e:
        parse_task({"id": "a", **bad})
    assert says in e.value.message
