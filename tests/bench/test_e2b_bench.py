"""``bunshin bench e2b`` runs end to end (tiny) with both sides of every row, and leaves nothing."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b_code_interpreter")
from bunshin.bench import e2b as bench_e2b  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_bench_e2b_reports_the_sdk_and_bunshin_side_by_side(no_leaks, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_e2b, "SDK_MAX_FORKS", 1)  # the fork of 2 takes E2B's REST route, as 32 does
    plan = bench_e2b.Plan(rounds=2, fork_sizes=(1, 2), fork_rounds=1, concurrent=2, seconds=0.3)
    r = bench_e2b.run(no_leaks, plan)
    c = r["create_ms"]
    assert all(c[k]["n"] == 2 and c[k]["p50"] > 0 for k in ("e2b_template", "bunshin_restore_ahead", "bunshin_restore",
                                                           "cold_image"))
    assert c["cold_over_template_p50"] > 0 and c["e2b_over_restore_p50"] > 0 and "ahead_saves_ms_p50" in c
    assert [(f["count"], f["via"]) for f in r["fork_ms"]] == [(1, "sdk"), (2, "rest")]
    assert all(f["failed"] == 0 for f in r["fork_ms"])
    assert r["commands_run_ms"]["e2b_commands_run"]["n"] == r["commands_run_ms"]["bunshin_exec_http"]["n"] == 2
    assert r["run_code_ms"]["e2b_run_code_over_bunshin_python_tool_p50"] > 0
    busy = r["concurrent"]
    assert busy["sandboxes"] == 2 and busy["e2b_commands_run"]["errors"] == busy["bunshin_exec_http"]["errors"] == 0
    assert busy["e2b_commands_run"]["calls"] > 0 and busy["bunshin_exec_http"]["calls"] > 0
    assert len(bench_e2b.rows(r)) == 3 + 2 + 2
    assert bench_e2b.plot(r, tmp_path / "e2b.png").stat().st_size > 1000
    bench_e2b.print_report(r)
