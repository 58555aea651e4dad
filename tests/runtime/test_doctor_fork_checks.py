"""bunshin doctor: the fork's host checks (CRIU's feature cache, room for clones in the pid space)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bunshin.runtime import snapshot
from bunshin.runtime.upkeep import doctor

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


def test_a_restore_out_of_pipe_buffers_says_which_host_limit_and_what_to_do(cfg):
    from bunshin.errors import CriuError, ResourceExhausted
    from bunshin.runtime.kernel import host_limits

    err = CriuError("criu restore failed with exit code 1",
                    first_errors="task 1: Can't restore pipe size: Operation not permitted (criu/pipes.c:165)")
    out = host_limits.explain_restore_failure(err, 1024)
    assert isinstance(out, ResourceExhausted) and "1024 clones" in str(out)
    assert "fs.pipe-user-pages-soft" in out.hint and "pipe buffers" in str(out)
    other = CriuError("criu restore failed", first_errors="task 1: Can't open file (criu/files-reg.c:2000)")
    assert host_limits.explain_restore_failure(other, 3) is None
    check = {c.name: c for c in doctor.run_checks(cfg)}["pipe buffers"]
    allowed = host_limits.pipes_allowed()
    # each workspace's root is a host user of its own: the budget bounds one workspace, not a batch
    assert check.ok and check.fix is None
    assert "no soft limit" in check.detail if allowed is None else f"~{allowed} pipes" in check.detail
    assert allowed is None or "per workspace" in check.detail
