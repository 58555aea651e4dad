"""A workspace's CPU seconds: its cgroup's count, exited processes included."""

from __future__ import annotations

import time

import pytest

from bunshin.runtime.container.cgroups import WorkspaceCgroup
from bunshin.workspace import Workspace


def test_cpu_seconds_from_v2_cpu_stat_and_v1_cpuacct(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert WorkspaceCgroup(2, (("memory", tmp_path), ("cpu", tmp_path))).cpu_seconds() == 2.5
    (tmp_path / "cpuacct.usage").write_text("1500000000\n")
    assert WorkspaceCgroup(1, (("cpu", tmp_path), ("cpuacct", tmp_path))).cpu_seconds() == 1.5
    assert WorkspaceCgroup(1, (("memory", tmp_path),)).cpu_seconds() == 0.0  # no cpuacct hierarchy


@pytest.mark.integration
def test_stats_count_the_cpu_time_of_the_whole_workspace(no_leaks):
    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        before = ws.stats().cpu_s
        assert before > 0  # its agent started already
        t0 = time.monotonic()
        # two processes that burn CPU and exit: their time stays on the workspace's bill (each
        # spins until the second clock has moved twice: 1-2 s; "+ 1" ended at the next tick,
        # which may come at once: CI saw 43 ms of it)
        r = ws.exec("for i in 1 2; do (end=$(($(date +%s) + 2)); while [ $(date +%s) -lt $end ]; do :; done) & done; wait",
                    timeout=30)
        wall = time.monotonic() - t0
        assert r.exit_code == 0, r
        used = ws.stats().cpu_s - before
        assert 0.3 < used < 2 * wall + 0.5, (used, wall)
    finally:
        ws.remove()
