"""Which records of an upstream's answer admit addresses: only the asked name's (through its CNAME chain)."""

from __future__ import annotations

import dns.message
import dns.rrset

from bunshin.runtime.net.resolver import _asked


def _answer(*records: tuple[str, str, str]) -> tuple[dns.message.Message, dns.message.Message]:
    query = dns.message.make_query("a.example.", "A")
    reply = dns.message.make_response(query)
    for owner, kind, data in records:
        reply.answer.append(dns.rrset.from_text(owner, 60, "IN", kind, data))
    return query, reply


def test_only_the_asked_name_and_its_cname_chain_admit() -> None:
    query, reply = _answer(("a.example.", "CNAME", "b.example."), ("b.example.", "A", "203.0.113.5"),
                           ("evil.example.", "A", "169.254.169.254"), ("a.example.", "A", "203.0.113.6"))
    got = sorted(rd.address for rrset in _asked(reply, query.question[0].name) for rd in rrset)
    assert got == ["203.0.113.5", "203.0.113.6"]


def test_a_cname_loop_ends() -> None:
    query, reply = _answer(("a.example.", "CNAME", "b.example."), ("b.example.", "CNAME", "a.example."))
    assert _asked(reply, query.question[0].name) == []
