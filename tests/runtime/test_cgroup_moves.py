"""favordynmods on the host's cgroup2: turned on, the mount's other flags kept."""

from __future__ import annotations

import pytest

from bunshin.runtime.container import cgroup_moves
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.upkeep import doctor

pytestmark = pytest.mark.integration


@pytest.fixture
def cgroup2():
    st = cgroup_moves.status()
    if st.mount_point is None:
        pytest.skip("no cgroup2 mounted")
    yield st
    cgroup_moves.reconfigure(cgroup_moves.status(), st.flags)  # as it was
    cgroup_moves._result = None


def _super_options(point: str) -> set[str]:
    entry = mountinfo.at(point)
    assert entry is not None
    return set(entry.super_options.split(","))


def test_ensure_turns_it_on_once_and_keeps_the_mounts_flags(cgroup2, monkeypatch, cfg):
    others = tuple(f for f in cgroup2.flags if f != cgroup_moves.OPTION)
    entry = mountinfo.at(cgroup2.mount_point)
    assert entry is not None
    cgroup_moves.reconfigure(cgroup2, others)
    assert not cgroup_moves.status().favored
    check = {c.name: c for c in doctor.run_checks(cfg)}["cgroup moves"]
    assert not check.ok and "remount" in (check.fix or "")

    monkeypatch.setenv(cgroup_moves.ENV, "0")  # the host's choice: left off
    cgroup_moves._result = None
    assert cgroup_moves.ensure() is False and not cgroup_moves.status().favored

    monkeypatch.delenv(cgroup_moves.ENV)
    cgroup_moves._result = None
    assert cgroup_moves.ensure() is True
    after = mountinfo.at(cgroup2.mount_point)
    assert after is not None and cgroup_moves.OPTION in after.super_options.split(",")
    assert set(others) <= _super_options(cgroup2.mount_point)  # nsdelegate & co. kept
    assert after.options == entry.options  # the mount's own flags (nosuid, ...) untouched
    assert {c.name: c for c in doctor.run_checks(cfg)}["cgroup moves"].ok
