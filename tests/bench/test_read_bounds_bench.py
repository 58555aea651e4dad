"""``bunshin bench read-bounds`` runs end to end (small) and reports every path's cost."""

from __future__ import annotations

import pytest

from bunshin.bench import read_bounds

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_bench_read_bounds_reports_every_path(no_leaks):
    r = read_bounds.run(no_leaks, mib=32)
    assert r["files_api"]["answered_bytes"] == r["download"]["answered_bytes"] == 32 << 20
    assert 0 < r["read_file_tool"]["answered_bytes"] < 300 << 10
    for path in ("files_api", "read_file_tool", "swerex_read_file", "download"):
        # the kernel's RSS counters are kept per CPU and read approximately: a path that
        # grew nothing can read a little below zero (CI saw -0.2 MiB)
        assert r[path]["peak_growth_mib"] > -1 and r[path]["seconds"] >= 0
    read_bounds.print_report(r)
