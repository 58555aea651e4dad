"""A sandbox holds at most ``MAX_STREAMS`` followed commands (or watched folders) at once:
each one polls through the server's shared thread pool under the sandbox's lock."""

from __future__ import annotations

import contextlib

import pytest

pytest.importorskip("connectrpc")

from connectrpc.code import Code  # noqa: E402
from connectrpc.errors import ConnectError  # noqa: E402

from bunshin.server.e2b.envd.rpc import MAX_STREAMS, Live  # noqa: E402


def test_streams_are_bounded_per_sandbox() -> None:
    live = Live("commands followed")
    with contextlib.ExitStack() as held:
        for _ in range(MAX_STREAMS):
            held.enter_context(live.held("ws-000000000001"))
        with pytest.raises(ConnectError) as e, live.held("ws-000000000001"):
            pass
        assert e.value.code == Code.RESOURCE_EXHAUSTED
        with live.held("ws-000000000002"):  # another sandbox's budget is its own
            assert live.count == MAX_STREAMS + 1
    assert live.count == 0 and not live._by_sandbox
