"""One tiny real run of ``bunshin bench fork``: every headline key, sane values, nothing left."""

from __future__ import annotations

import json

import pytest

from bunshin.bench import fork as fork_bench
from bunshin.bench import fork_report
from bunshin.errors import InvalidArgument

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_tiny_run_reports_every_headline_number(no_leaks, tmp_path):
    r = fork_bench.run(no_leaks, sizes=(2,), heap_mib=16, cold=1, depth=2)
    cow, copy = r["bunshin"], r["copy"]
    assert cow["clones"] == 2 and copy["clones"] == min(2, copy["clones"]) and copy["asked"] == 2
    for m in (cow, copy):
        assert 0 < m["restore_ms_p50"] <= m["restore_ms_p90"] <= m["restore_ms_p99"]
        assert 0 < m["parent_pause_ms"] < m["dump_ms"] < m["fork_wall_ms"]
        assert m["clones_added_bytes"] > 0 and 0 < m["clones_added_share_of_parent"] < 10
        assert m["call_ms_p50"] > 0 and m["remove_all_ms"] > 0
        assert m["criu"]["frozen_ms"] == m["parent_pause_ms"] and m["criu"]["pages_written"] > 0
        steps = m["restore_steps_ms_p50"]
        assert set(steps) == {"prepare", "criu_call", "after"} and min(steps.values()) > 0
        assert steps["criu_call"] >= m["restore_ms_p50"] - 0.01  # the criu run and reading its pidfile
    assert cow["memfile_bytes"] >= 16 << 20 and copy["memfile_bytes"] == 0
    # copy-on-write: a clone owns a small part of the 16 MiB heap, a copied one all of it, also after
    # an exec and a tool call
    assert cow["private_bytes_per_clone"] < (8 << 20) < copy["private_bytes_per_clone"]
    assert cow["private_bytes_after_call"] < (8 << 20) < copy["private_bytes_after_call"]
    first = r["first_fork"]
    assert 0 < first["pause_ms"] <= first["dump_ms"] < first["snapshot_wall_ms"] < first["fork_wall_ms"]
    assert first["rewrite_ms"] > 0 and first["memfile_bytes"] >= 16 << 20 and first["criu"]["freezing_ms"] >= 0
    assert r["cold"]["start_ms_p50"] > 0 and r["parent_pause_ms"] > 0
    assert [d["depth"] for d in r["depth"]] == [1, 2] and r["depth"][1]["memfile_bytes"] == 0
    assert r["host"]["pid_max"] > 0
    report = fork_report.write(r, tmp_path / "rep")
    assert "| bunshin | 2 |" in report.read_text()
    assert (tmp_path / "rep" / "fork.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "rep" / "results.json").read_text())["heap_mib"] == 16


def test_one_mode_alone(no_leaks):
    r = fork_bench.run(no_leaks, sizes=(1,), heap_mib=16, cold=0, depth=0, modes=("cow",))
    assert r["copy"] == {} and r["bunshin"]["clones"] == 1 and "depth" not in r and r["cold"] == {}


def test_bad_sizes_and_modes_are_refused(no_leaks):
    with pytest.raises(InvalidArgument):
        fork_bench.run(no_leaks, sizes=(0,))
    with pytest.raises(InvalidArgument, match="unknown modes"):
        fork_bench.run(no_leaks, sizes=(1,), modes=("fast",))


def test_with_and_without_the_trap_side_by_side(no_leaks):
    r = fork_bench.run(no_leaks, sizes=(1,), heap_mib=16, cold=0, depth=0, modes=("cow", fork_bench.UNTRAPPED))
    trapped, untrapped = r["bunshin"], r["untrapped"]
    assert r["copy"] == {} and trapped["clones"] == untrapped["clones"] == 1
    for m in (trapped, untrapped):  # both share the heap
        assert m["memfile_bytes"] >= 16 << 20 and m["private_bytes_per_clone"] < (8 << 20)
