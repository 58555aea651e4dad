"""The results records (docs/results/*.json) and what the docs make of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bunshin.bench import results
from bunshin.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


def _record(**over):
    rec = {"bench": "toy", "command": "toy --json", "date": "2026-12-05T16:00:00Z", "commit": "abc",
           "machine": {"cpus": 2, "mem_gib": 23.5, "kernel": "6.18"}, "load": [1.0, 2.0, 3.0],
           "results": {"a": {"b": 1.5}, "xs": [1, 2]}}
    rec.update(over)
    return rec


def test_committed_records_parse_and_render():
    records = results.load_all(ROOT / "docs" / "results")
    assert {r.bench for r in records} >= {"fork"}
    page = results.render_page(records)
    for rec in records:
        assert f"## {rec.bench}" in page and rec.command in page and rec.date in page
    # every headline of a committed bench finds its numbers (a renamed key fails here)
    rows = results.headline_rows(records)
    assert len(rows) == sum(1 for h in results.HEADLINES if h.bench in {r.bench for r in records})


@pytest.mark.parametrize("bad", [
    {"load": [1.0]}, {"machine": {"cpus": 2}}, {"date": "yesterday"}, {"results": [1, 2]},
])
def test_malformed_records_are_refused(bad):
    with pytest.raises(InvalidArgument, match="toy.json"):
        results.parse(_record(**bad), "toy.json")


def test_a_record_missing_a_key_is_refused():
    rec = _record()
    del rec["commit"]
    with pytest.raises(InvalidArgument, match="needs the keys"):
        results.parse(rec, "toy.json")


def test_record_runs_the_command_and_writes_the_shape(tmp_path):
    out = tmp_path / "toy.json"
    cmd = [sys.executable, "-c", "import json; print(json.dumps({'p50_ms': 1.25}))"]
    rec = results.record("toy", cmd, out)
    data = json.loads(out.read_text())
    assert set(data) == set(results.KEYS)
    assert data["results"] == {"p50_ms": 1.25} and data["bench"] == "toy"
    assert data["machine"]["cpus"] >= 1 and len(data["load"]) == 3 and data["date"].endswith("Z")
    assert results.parse(data, "toy.json") == rec


def test_record_refuses_a_failing_or_silent_command(tmp_path):
    out = tmp_path / "toy.json"
    with pytest.raises(InvalidArgument, match="exited 3"):
        results.record("toy", [sys.executable, "-c", "raise SystemExit(3)"], out)
    with pytest.raises(InvalidArgument, match="did not print one JSON object"):
        results.record("toy", [sys.executable, "-c", "print('hello')"], out)
    assert not out.exists()


def test_record_main_keeps_a_separator_of_the_command(tmp_path):
    out = tmp_path / "toy.json"
    code = "import json, sys; print(json.dumps({'argv': sys.argv[1:]}))"
    assert results.main(["record", "--bench", "toy", "--out", str(out), "--", sys.executable, "-c", code, "--", "x"]) == 0
    assert json.loads(out.read_text())["results"] == {"argv": ["--", "x"]}


def test_readme_update_writes_between_the_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{results.START}\nhand edit\n{results.END}\nafter\n")
    recs = [results.parse(_record(), "toy.json")]
    assert results.update_readme(readme, recs) is True
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n") and "hand edit" not in text
    assert results.update_readme(readme, recs) is False
    readme.write_text("no markers\n")
    with pytest.raises(InvalidArgument, match="markers are missing"):
        results.update_readme(readme, recs)
