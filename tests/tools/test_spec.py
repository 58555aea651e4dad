"""The one vocabulary of tools, cache, speculation and rollout: ToolCall, Observation, Step."""

from __future__ import annotations

from bunshin.rollout import records
from bunshin.tools import Observation, Step, ToolCall, call_key
from bunshin.tools.spec import Observation as SpecObservation


def test_one_observation_type_renders_what_the_model_reads():
    assert records.StepObservation is Observation is SpecObservation
    assert Observation("out", 2).text() == "out\n[exit code 2]"
    assert Observation("", None, "no such file").text() == "[error: no such file]"
    assert Observation("partial", None, timed_out=True).text() == "partial\n[timed out]"
    assert Observation("fine", 0).text() == "fine"
    assert Observation("x").exit_code is None and not Observation("x").ok


def test_a_call_is_its_tool_and_arguments_whatever_its_chat_id():
    a, b = ToolCall("bash", {"command": "ls"}), ToolCall("bash", {"command": "ls"})
    assert a.id != b.id and a == b and a.key == ""
    checked = ToolCall("bash", {"command": "ls"}, key=call_key("bash", {"command": "ls"}))
    assert checked != a and checked.key == '["bash",{"command":"ls"}]'
    assert a.openai() == {"id": a.id, "type": "function",
                          "function": {"name": "bash", "arguments": '{"command": "ls"}'}}


def test_a_step_reads_as_its_call():
    s = Step(1, 0.5, ToolCall("read_file", {"path": "/a"}))
    assert (s.name, s.arguments, s.observation, s.latency_s) == ("read_file", {"path": "/a"}, None, 0.0)
