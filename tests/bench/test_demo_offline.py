"""The demo's tasks ship with bunshin: its workloads are built with no network at all."""

from __future__ import annotations

import os
import subprocess
import sys

from bunshin.bench import demo

BUILD = """
from bunshin.bench import demo, workloads as wl
p = demo.plan()
for name in p.workloads:
    w = wl.build(name, tasks=p.tasks, traces=max(p.group_sizes), seed=p.seed, think_scale=p.think_scale, rows=p.rows)
    assert w.tasks and w.traces, name
print(",".join(p.workloads))
"""


def test_demo_workloads_build_in_a_namespace_without_network(tmp_path):
    """`unshare -n`: a network namespace with only a loopback that is down, so any download fails."""
    assert "coding" not in demo.plan().workloads  # the PyPI sdist one
    env = {**os.environ, "BUNSHIN_HOME": str(tmp_path)}
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", BUILD], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == ",".join(demo.DEMO_WORKLOADS)
    assert not any(tmp_path.rglob("*.tar.gz"))  # nothing fetched into the home either
