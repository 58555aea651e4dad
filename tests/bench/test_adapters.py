"""``bunshin bench adapters``: the trace-to-bash mapping, bad input, and a tiny real run
(its shape, not its speed: the numbers are the benchmark's)."""

from __future__ import annotations

import pytest

from bunshin import Workspace
from bunshin.bench import adapters
from bunshin.errors import InvalidArgument


def test_tool_calls_as_bash_do_what_the_tools_do(no_leaks) -> None:
    with Workspace.create("host", memory="512M", config=no_leaks) as ws:
        ws.files.write("/w/a.py", "x = 'it''s'\ny = 1\n")
        edit = adapters.as_command("edit", {"path": "/w/a.py", "old_str": "y = 1", "new_str": "y = \"two\""})
        assert ws.exec(edit).ok
        assert ws.exec(adapters.as_command("read_file", {"path": "/w/a.py"})).stdout == "x = 'it''s'\ny = \"two\"\n"
        again = ws.exec(edit)  # the old text is gone: a failing edit, as the tool's error
        assert again.exit_code == 1 and "found 0 times" in again.stderr
        assert ws.exec(adapters.as_command("write_file", {"path": "/w/b", "content": "$HOME `x`"})).ok
        assert ws.files.read("/w/b") == b"$HOME `x`"
    with pytest.raises(InvalidArgument, match="python"):
        adapters.as_command("python", {"code": "1"})


def test_bad_arguments_are_refused(cfg) -> None:
    with pytest.raises(InvalidArgument, match="framework"):
        adapters.run(cfg, framework="nope")
    with pytest.raises(InvalidArgument, match="mode"):
        adapters.run(cfg, modes=("baseline", "nope"))
    with pytest.raises(InvalidArgument, match="workload"):
        adapters.run(cfg, workload="nope", group=1)


def test_tiny_run_both_modes(no_leaks) -> None:
    r = adapters.run(no_leaks, group=2, think_scale=0.0, workload="coding-lite", settle_s=0.0)
    base, fork, served = r["modes"]
    assert [(m["label"], m["group_fork"]) for m in r["modes"]] == [
        ("baseline", False), ("fork", True), ("fork:served", True)]
    for m in (base, fork, served):
        assert m["exit_status"] == ["Submitted", "Submitted"] and not m["errors"]
        assert all(isinstance(x, float) for x in m["rewards"])
        assert m["makespan_s"] > 0 and m["ws_peak_bytes"] > 0
    assert r["same_rewards"] and set(fork["vs_baseline"]) == {"peak_bytes", "gb_s", "makespan_s", "ws_peak_bytes"}
