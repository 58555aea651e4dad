"""One tiny real run of ``bunshin bench fork --mode precopy``: both sides, the pre-copy's phases, nothing left."""

from __future__ import annotations

import pytest

from bunshin.bench import fork_precopy
from bunshin.errors import InvalidArgument
from bunshin.runtime.criu import fork_boost

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_tiny_side_by_side_run(no_leaks) -> None:
    r = fork_precopy.run(no_leaks, heap_mib=48, sizes=(1,))
    off, on = r["sides"]["off"], r["sides"]["on"]
    assert "precopy" not in off["first_fork"]
    live = on["first_fork"]["precopy"]
    heap = [c for c in live["converted"] if c["bytes"] >= 48 << 20]
    assert len(heap) == 1, live  # the heap program, converted live; the small agent left to CRIU
    c = heap[0]
    assert 0 < c["pause_ms"] <= c["stopped_ms"] and c["stops"] >= 1 and c["precopy_ms"] > 0
    assert on["first_fork"]["criu_pause_ms"] > 0
    # the host's threads' CPU weight meanwhile, as the report says
    assert on["first_fork"]["phases"]["precopy_cpu_boost"] == (fork_boost.factor() if fork_boost.cpu_root() else 1)
    assert on["first_fork"]["pause_ms"] == pytest.approx(on["first_fork"]["criu_pause_ms"] + live["pause_ms"], abs=0.05)
    # the dump after it holds what the other processes own and what the heap wrote since: not the heap
    assert on["first_fork"]["criu"]["pages_written"] * 4096 < (48 << 20) < off["first_fork"]["criu"]["pages_written"] * 4096
    for side in (off, on):
        (later,) = side["sizes"]
        assert later["clones"] == 1 and later["parent_pause_ms"] > 0 and later["call_ms_p50"] > 0


def test_refusals() -> None:
    with pytest.raises(InvalidArgument, match="positive"):
        fork_precopy.run(None, heap_mib=0)  # type: ignore[arg-type]
