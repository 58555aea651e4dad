"""One real run of ``bunshin bench trap``: every timing, on both sides, nothing left."""

from __future__ import annotations

import pytest

from bunshin.bench import trap_cost
from bunshin.errors import InvalidArgument

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_one_round_reports_every_timing(no_leaks):
    r = trap_cost.run(no_leaks, rounds=1, mib=8)
    assert r["rounds"] == 1 and r["calls_per_round"] > 0
    for side in ("clone", "parent"):
        assert set(r[side]) == set(trap_cost.KEYS) and all(v > 0 for v in r[side].values())
    assert r["trap_overhead_ns"] == {k: r["clone"][k] - r["parent"][k] for k in trap_cost.KEYS}


def test_bad_arguments_are_refused(no_leaks):
    with pytest.raises(InvalidArgument, match="rounds"):
        trap_cost.run(no_leaks, rounds=0)
