"""``bunshin bench serve`` runs end to end (small) and reports both sides and every row."""

from __future__ import annotations

import pytest

from bunshin.bench import serve as bench_serve

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_bench_serve_reports_local_and_http_side_by_side(no_leaks):
    r = bench_serve.run(no_leaks, rounds=3, forks=1, seconds=0.3, clients=(1, 2))
    for key in ("exec_ms", "tool_call_ms", "fork_ms"):
        assert r[key]["local"]["n"] == r[key]["http"]["n"] > 0
        assert r[key]["http"]["p50"] > 0 and r[key]["http_over_local_p50"] > 0
    assert [t["clients"] for t in r["exec_throughput"]] == [1, 2]
    assert all(t["calls"] > 0 and t["errors"] == 0 for t in r["exec_throughput"])
    bench_serve.print_report(r)
