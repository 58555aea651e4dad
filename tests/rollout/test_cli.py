"""``bunshin rollout`` argument and spec errors (no workspace needed)."""

from __future__ import annotations

import json

from bunshin.cli.main import main


def test_bad_task_spec_names_the_field(tmp_path, capsys):
    task = tmp_path / "t.yaml"
    task.write_text("id: a\nmax_turns: zero\n")
    traces = tmp_path / "tr.jsonl"
    traces.write_text(json.dumps({"steps": []}) + "\n")
    assert main(["rollout", str(task), "--policy", str(traces)]) == 125
    assert "field 'max_turns'" in capsys.readouterr().err


def test_bad_policy(tmp_path, capsys):
    task = tmp_path / "t.json"
    task.write_text(json.dumps({"id": "a"}))
    assert main(["rollout", str(task), "--policy", str(tmp_path / "none.jsonl")]) == 125
    assert "no such file" in capsys.readouterr().err
    assert main(["rollout", str(task), "--policy", "openai"]) == 125
    assert "--model" in capsys.readouterr().err
    assert main(["rollout", str(task), "--policy", "py:nosuchmodule:f"]) == 125
    assert "nosuchmodule" in capsys.readouterr().err
