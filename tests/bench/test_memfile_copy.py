"""``bunshin bench memfile-copy`` on bunshin's own tmpfs: every method checked and timed, nothing left."""

from __future__ import annotations

import os

import pytest

from bunshin.bench import memfile_copy
from bunshin.errors import InvalidArgument
from bunshin.runtime.container import statefs

pytestmark = [pytest.mark.integration]


def test_every_method_copies_and_is_timed(cfg):
    r = memfile_copy.run(cfg, mib=8, rounds=2, zero_share=0.3)
    assert set(r["methods"]) == set(memfile_copy.METHODS)
    for m in r["methods"].values():
        assert len(m["gb_per_s"]) == 2 and all(v > 0 for v in m["gb_per_s"])
    # zero pages: the write_data copies leave holes where the kernel copies write zeros
    assert r["methods"]["write_data"]["data_mib"] < r["methods"]["copy_file_range"]["data_mib"] == 8
    if r["huge_memfiles"]:
        assert r["methods"]["write_data_huge"]["data_mib"] == 8  # dense regions whole, as huge pages
    left = [p for d in (cfg.tmpfs, statefs.images_root(cfg)) for p in os.listdir(d) if "memfile-copy" in p]
    assert left == []


@pytest.mark.parametrize("kw", [{"mib": 3}, {"mib": 0}, {"rounds": 0}, {"zero_share": 1.0}, {"methods": ("mmap",)}])
def test_bad_arguments_are_refused(cfg, kw):
    with pytest.raises(InvalidArgument):
        memfile_copy.run(cfg, **kw)
