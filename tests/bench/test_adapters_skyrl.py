"""``bunshin bench adapters --framework skyrl``: bad input, and a tiny real run in every mode
(its shape and rewards, not its speed: the numbers are the benchmark's)."""

from __future__ import annotations

import pytest

from bunshin.bench import adapters, adapters_skyrl
from bunshin.errors import InvalidArgument


def test_bad_arguments_are_refused(cfg) -> None:
    with pytest.raises(InvalidArgument, match="mode"):
        adapters.run(cfg, framework="skyrl", modes=("baseline", "nope"))
    with pytest.raises(InvalidArgument, match="workload"):
        adapters.run(cfg, framework="skyrl", workload="nope", group=1)
    with pytest.raises(InvalidArgument, match="group"):
        adapters_skyrl.run(cfg, group=0)


@pytest.mark.criu
def test_tiny_run_every_mode(no_leaks) -> None:
    from bunshin.adapters.trajectories import close_all

    try:
        r = adapters.run(no_leaks, framework="skyrl", group=2, think_scale=0.0, workload="coding-lite",
                         settle_s=0.0)
    finally:
        close_all()
    assert r["framework"] == "skyrl-gym" and [m["label"] for m in r["modes"]] == list(adapters_skyrl.MODES)
    for m in r["modes"]:
        assert not m["errors"] and len(m["rewards"]) == 2 and all(0 <= x <= 1 for x in m["rewards"])
        assert m["makespan_s"] > 0 and m["ws_peak_bytes"] > 0 and m["calls"] > 0
    by = {m["label"]: m for m in r["modes"]}
    assert by["baseline"]["cached_calls"] == by["fork"]["cached_calls"] == 0  # no cache in those modes
    assert by["fork+cache"]["cached_calls"] > 0 and by["fork:served"]["cached_calls"] > 0  # same first calls
    assert r["same_rewards"] and set(by["fork"]["vs_baseline"]) == {"peak_bytes", "gb_s", "makespan_s",
                                                                   "ws_peak_bytes"}
