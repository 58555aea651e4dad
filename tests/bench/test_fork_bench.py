"""One tiny real run of ``bunshin bench fork``: every headline key, sane values, nothing left."""

from __future__ import annotations

import pytest

from bunshin.bench import fork as fork_bench
from bunshin.errors import InvalidArgument

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_tiny_run_reports_every_headline_number(no_leaks):
    r = fork_bench.run(no_leaks, sizes=(2,), heap_mib=16, cold=1, depth=2)
    cow, copy = r["bunshin"], r["copy"]
    assert cow["clones"] == 2 and copy["clones"] == min(2, r["copy_cap"])
    for m in (cow, copy):
        assert 0 < m["restore_ms_p50"] <= m["restore_ms_p99"]
        assert 0 < m["parent_pause_ms"] < m["dump_ms"] < m["fork_wall_ms"]
        assert m["clones_added_bytes"] > 0 and 0 < m["clones_added_share_of_parent"] < 10
    assert cow["memfile_bytes"] >= 16 << 20 and copy["memfile_bytes"] == 0
    # copy-on-write: a clone owns a small part of the 16 MiB heap, a copied one all of it
    assert cow["private_bytes_per_clone"] < (8 << 20) < copy["private_bytes_per_clone"]
    assert r["cold"]["start_ms_p50"] > 0 and r["parent_pause_ms"] > 0
    assert [d["depth"] for d in r["depth"]] == [1, 2] and r["depth"][1]["memfile_bytes"] == 0


def test_bad_sizes_are_refused(no_leaks):
    with pytest.raises(InvalidArgument):
        fork_bench.run(no_leaks, sizes=(0,))
