"""``bunshin bench clone-memory`` on a real clone: every stage measured, per process, nothing left."""

from __future__ import annotations

import pytest

from bunshin.bench import clone_memory
from bunshin.errors import InvalidArgument

pytestmark = [pytest.mark.integration, pytest.mark.criu]


@pytest.mark.parametrize("calls", ["thread", "fork"])
def test_a_clone_is_measured_at_every_stage(no_leaks, calls):
    r = clone_memory.run(no_leaks, clones=1, calls=calls, rounds=3)
    assert r["calls"] == calls
    (m,) = r["clones"]
    assert [s.name for s in m.stages] == list(clone_memory.STAGES)
    fresh, after_exec, after_tool = m.stages
    # restored from the snapshot: the agent, the parent's session (its shell, and with
    # --calls fork its holder); the helpers that served each call have ended before a stage
    # is measured
    roles = {"agent", "holder", "shell"} if calls == "fork" else {"agent", "shell"}
    for stage in m.stages:
        assert {p.role for p in stage.processes} == roles, stage
        assert len([p for p in stage.processes if p.role == "agent"]) == 1
        assert all(p.threads >= 1 for p in stage.processes)
    assert fresh.anon_bytes < r["parent"]["anon_bytes"] // 4
    # calls copy pages on write: the totals only grow, and the exec's shows in the agent's areas
    assert fresh.anon_bytes < after_exec.anon_bytes <= after_tool.anon_bytes
    assert m.agent_areas_exec and sum(a.grew_bytes for a in m.agent_areas_exec) > 0
    assert r["after_tool"]["anon_bytes_p50"] == after_tool.anon_bytes
    # the tool call runs in the session: with --calls fork its holder's written areas are
    # listed, per role too
    if calls == "fork":
        assert m.holder_areas_tool and r["roles"]["after_tool"]["holder"] > 0
    assert sum(r["roles"]["after_tool"].values()) == after_tool.anon_bytes
    # then timed: three of each, their p50 reported
    assert len(m.exec_ms) == len(m.tool_ms) == 3 and all(t > 0 for t in m.exec_ms + m.tool_ms)
    assert r["latency_ms"]["exec_p50"] == round(sorted(m.exec_ms)[1], 2)
    assert r["latency_ms"]["rounds"] == 3 and r["agent_python"].startswith("3.")


def test_no_clones_is_refused(no_leaks):
    with pytest.raises(InvalidArgument, match="at least 1"):
        clone_memory.run(no_leaks, clones=0)
    with pytest.raises(InvalidArgument, match="rounds must be 0 or more") as e:
        clone_memory.run(no_leaks, clones=1, rounds=-1)
    assert "--rounds" in (e.value.hint or "")
    with pytest.raises(InvalidArgument, match="calls must be among") as e:
        clone_memory.run_calls(no_leaks, clones=1, calls=["threads"])
    assert "--calls" in (e.value.hint or "")
