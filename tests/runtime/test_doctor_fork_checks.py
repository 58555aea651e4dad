"""bunshin doctor: the fork's host checks (CRIU's feature cache, room for clones in the pid space)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bunshin.runtime import doctor, snapshot

pytestmark = pytest.mark.criu


def test_clone_capacity_is_what_pid_max_leaves(cfg):
    checks = {c.name: c for c in doctor.run_checks(cfg)}
    cap = checks["clone capacity"]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    m = re.search(r"kernel\.pid_max (\d+), (\d+) tasks now.*room for ~(\d+) more clones of (\d+) tasks", cap.detail)
    assert m, cap.detail
    assert int(m[1]) == pid_max
    expected = (int(pid_max * (1 - snapshot.PID_MARGIN)) - int(m[2])) // int(m[4])
    assert int(m[3]) == max(expected, 0)
    assert cap.ok == (int(m[3]) >= snapshot.MAX_BATCH)
    assert cap.ok or "kernel.pid_max=" in (cap.fix or "")
    assert checks["criu cache"].ok, checks["criu cache"].detail  # made on first use where /run is no tmpfs
