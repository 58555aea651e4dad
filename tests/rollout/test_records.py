"""A trajectory's JSONL row: the calls in their wire form."""

from __future__ import annotations

import json

from bunshin.rollout.records import Status, Timings, TrajectoryResult
from bunshin.tools import Observation, Step, ToolCall


def test_row_steps_carry_the_wire_call_and_the_observation():
    call = ToolCall("bash", {"command": "ls"}, id="call-0", key='["bash",{"command":"ls"}]')
    t = TrajectoryResult("r", "t", "g", "g-0", 0, "bunshin", {}, Status.COMPLETED, 1.0, [],
                         [Step(1, 0.25, call, Observation("a\n", 0), 0.1)], Timings())
    row = json.loads(json.dumps(t.to_row()))
    step = row["steps"][0]
    assert step["tool_call"] == {"name": "bash", "arguments": {"command": "ls"}, "id": "call-0"}
    assert step["observation"] == {"output": "a\n", "exit_code": 0, "error": None, "timed_out": False,
                                   "duration_s": 0.0, "cached": False, "speculated": False, "images": []}
    assert (step["turn"], step["think_s"], step["latency_s"], row["turns"]) == (1, 0.25, 0.1, 1)
