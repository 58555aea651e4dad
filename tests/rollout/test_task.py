"""Task specs and reward parsing (no workspace needed)."""

from __future__ import annotations

import json

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout.task import SetupStep, load_task, parse_reward, parse_task


def test_yaml_task_with_every_field(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("""
id: fix-parser
image: host
memory: 1G
files: {/work/a.py: "print(1)\\n"}
setup:
  - echo hi
  - {run: "sleep 100", background: true}
tools: [bash, read_file]
prompt: do it
max_turns: 5
reward: "python3 /work/score.py"
call_timeout: 10
trajectory_timeout: 100
""")
    t = load_task(p)
    assert t.id == "fix-parser" and t.max_turns == 5 and t.tools == ("bash", "read_file")
    assert t.setup == (SetupStep(run="echo hi"), SetupStep(run="sleep 100", background=True))
    assert t.reward is not None and t.reward.command == "python3 /work/score.py"
    assert t.initial_messages() == [{"role": "user", "content": "do it"}]


def test_json_task_and_defaults(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"id": "a", "setup": "echo once", "system": "be brief"}))
    t = load_task(p)
    assert t.image == "host" and t.tools is None and t.reward is None and t.setup[0].run == "echo once"
    assert t.initial_messages()[0] == {"role": "system", "content": "be brief"}


@pytest.mark.parametrize("data, field", [
    ({}, "id"),
    ({"id": "a", "max_turns": 0}, "max_turns"),
    ({"id": "a", "colour": "red"}, "colour"),
    ({"id": "a", "files": {"rel/path": ""}}, "files"),
    ({"id": "a", "setup": [{"run": ""}]}, "setup.0.run"),
    ({"id": "a", "reward": {"timeout": 3}}, "reward.command"),
    ({"id": "a", "call_timeout": -1}, "call_timeout"),
    ({"id": "a b"}, "id"),
    ({"id": "a", "tools": ["bash", "bash"]}, "(top level)"),
])
def test_bad_specs_name_the_field(data, field):
    with pytest.raises(InvalidArgument) as ei:
        parse_task(data)
    assert f"field '{field}'" in ei.value.message


def test_bad_files(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot read task file"):
        load_task(tmp_path / "missing.yaml")
    p = tmp_path / "t.yaml"
    p.write_text("id: [unclosed")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        load_task(p)
    p.write_text("- just a list")
    with pytest.raises(InvalidArgument, match="expected a mapping"):
        load_task(p)


@pytest.mark.parametrize("out, value", [
    ("1\n", 1.0), ("score: 0.75\n", 0.75), ("tests 3/4\n0.5\n\n", 0.5), ("-2e-1", -0.2), ("passed 7 of 9 → 7", 7.0),
])
def test_parse_reward(out, value):
    assert parse_reward(out) == value


@pytest.mark.parametrize("out", ["", "no number here", "nan"])
def test_parse_reward_rejects(out):
    with pytest.raises(ValueError):
        parse_reward(out)
