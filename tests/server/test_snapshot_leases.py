"""Snapshots loaded with a ``ttl`` (a cluster head's root copies): removed by the server when
their lease runs out, kept while it is renewed; a bad lease is refused."""

from __future__ import annotations

import time

import pytest

from bunshin.errors import InvalidArgument, NotFound

from .conftest import Served

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_a_loaded_snapshot_lives_as_long_as_its_lease_is_renewed(served: Served, tmp_path):
    with served.client() as c:
        ws = c.create(memory="128M")
        try:
            ws.exec("echo x > /work/f")
            saved = ws.snapshot()
            saved.save(tmp_path / "saved")
            saved.remove()
            kept = ws.snapshot()  # no lease: stays
        finally:
            ws.remove()
        leased = c.load_snapshot(tmp_path / "saved", ttl=2.0)
        assert leased.id != kept.id
        try:
            for _ in range(3):  # renewed past its lease
                time.sleep(1.0)
                leased.set_ttl(2.0)
            assert leased.id in {s.id for s in c.snapshots()}
            deadline = time.monotonic() + 15
            while leased.id in {s.id for s in c.snapshots()}:  # no more renewals: it goes
                assert time.monotonic() < deadline, "the lease ran out, the snapshot stayed"
                time.sleep(0.2)
            ids = {s.id for s in c.snapshots()}
            assert ids == {kept.id}
            with pytest.raises(NotFound):
                leased.set_ttl(2.0)
            with pytest.raises(InvalidArgument):
                kept.set_ttl(0)
            with pytest.raises(InvalidArgument):
                c.load_snapshot(tmp_path / "saved", ttl=-1)
            assert {s.id for s in c.snapshots()} == ids  # the refused load made nothing
        finally:
            kept.remove()
