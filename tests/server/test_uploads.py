"""The server's one upload budget: uploads in flight share the cap and the disk's room, an
upload refused changes nothing, and one that ends gives its bytes back."""

from __future__ import annotations

import os

import pytest

from bunshin.errors import PayloadTooLarge, RateLimited, ResourceExhausted
from bunshin.server import uploads
from bunshin.server.uploads import Uploads


def test_uploads_in_flight_share_the_cap(tmp_path):
    budget = Uploads(cap=100)
    with budget.open(tmp_path, what="snapshot") as a:
        a.check(60)
        with budget.open(tmp_path, what="file") as b:
            with pytest.raises(RateLimited, match="1 uploads in flight \\(60 bytes\\)") as e:
                b.check(50)
            assert e.value.details["retry_after"] > 0 and b.size == 0  # refused: nothing taken
            b.check(40)
            with pytest.raises(PayloadTooLarge, match="limit of 100"):  # never fits, whatever is in flight
                b.check(101)
        with budget.open(tmp_path, what="file") as c:  # b's bytes are back
            c.check(40)
            with pytest.raises(RateLimited):
                a.check(61)
    with budget.open(tmp_path) as d:
        d.check(100)


def test_uploads_in_flight_share_the_disk(tmp_path, monkeypatch):
    real = os.statvfs

    def disk_with(free: int):
        def statvfs(path):
            st = real(path)
            return type("St", (), {"f_bavail": (uploads.DISK_MARGIN + free) // st.f_frsize, "f_frsize": st.f_frsize})()
        return statvfs

    monkeypatch.setattr(uploads.os, "statvfs", disk_with(10 << 20))
    budget = Uploads(cap=None)
    with budget.open(tmp_path, what="snapshot", factor=2) as a:  # 4 MiB body: 4 more to unpack it
        a.check(4 << 20)
        with budget.open(tmp_path, what="snapshot", factor=2) as b:
            # alone it would fit (2 x 4 MiB of 10); with a's unpacked copy still to come it does not
            with pytest.raises(ResourceExhausted, match="still need"):
                b.check(4 << 20)
            b.check(2 << 20)
    with budget.open(tmp_path, what="snapshot", factor=2) as alone, \
            pytest.raises(ResourceExhausted, match="bunshin gc"):
        alone.check(6 << 20)  # 6 MiB and its unpacked 6: more than the 10 free
