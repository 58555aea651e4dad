"""The per-sandbox tokens: each opens its own sandbox and kind only."""

from __future__ import annotations

from bunshin.server.e2b.auth import (
    envd_access_token,
    envd_token_ok,
    traffic_access_token,
    traffic_token_ok,
)


def test_each_token_opens_its_own_sandbox_and_kind_only():
    envd, traffic = envd_access_token("srv", "ws-a"), traffic_access_token("srv", "ws-a")
    assert envd != traffic
    assert envd_token_ok("srv", "ws-a", envd) and traffic_token_ok("srv", "ws-a", traffic)
    assert not envd_token_ok("srv", "ws-a", traffic) and not traffic_token_ok("srv", "ws-a", envd)
    assert not traffic_token_ok("srv", "ws-b", traffic) and not envd_token_ok("srv", "ws-b", envd)
    assert not traffic_token_ok("other", "ws-a", traffic)
    assert not traffic_token_ok("srv", "ws-a", None) and not traffic_token_ok("srv", "ws-a", "")
