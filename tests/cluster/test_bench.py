"""``bunshin bench cluster`` on a small plan: every size completes with the one-host rewards.

It runs as its own process (the CLI, ``--json``): the benchmark starts and stops a Ray
cluster of its own, and this test process keeps to the one session of the package's
fixture (Ray sessions started one after another in one process, with threads using
Ray's API, can crash it: ray-project/ray#31145)."""

from __future__ import annotations

import pytest

from bunshin.cli import exits
from bunshin.cli.main import main
from bunshin.config import Config

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_bench_cluster_small_plan(tmp_path):
    import json
    import os
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root")
    cfg = Config.for_home(tmp_path / "head", criu=Config.from_env().criu)
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu)}
    out = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "bench", "cluster", "--hosts", "1,2", "--tasks",
                          "1", "--group", "4", "--think-scale", "0.1", "--json"], capture_output=True, text=True,
                         timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    one, two = r["sizes"]
    assert [s["hosts"] for s in r["sizes"]] == [1, 2]
    for s in r["sizes"]:
        assert s["failed"] == 0 and s["trajectories"] == 4 and s["same_rewards_as_first"]
        assert sum(s["trajectories_per_host"].values()) == 4 and all(v > 0 for v in s["peak_mib_per_host"].values())
    assert one["migrations"] == 0 and one["trajectories_per_host"] == {"h0": 4}
    # one task on two hosts of 2 slots: half stay on the holder, the root is copied once
    assert two["trajectories_per_host"] == {"h0": 2, "h1": 2} and two["migrations"] == 1 and two["migrate_s"] > 0
    assert set(r["scheduler_us_per_placement"]) == {"1", "2", "4", "16", "64"}
    for s in r["sizes"]:  # sharing a tree over hosts can only add hits
        assert 0 < s["per_host_tree_hit_bound"] <= s["shared_tree_hit_bound"] < s["calls"]
    assert one["per_host_tree_hit_bound"] == one["shared_tree_hit_bound"]  # one host: one tree either way
    for s in r["sizes"]:  # the hits a shared tree adds, each costed from the run's own timings
        st = s["shared_tree"]
        assert st["added_hits"] == s["shared_tree_hit_bound"] - s["per_host_tree_hit_bound"]
        assert st["pays_by_replay"] == 0 and st["pays_by_move"] <= st["added_hits"]
    assert one["shared_tree"]["added_hits"] == 0 and one["shared_tree"]["move_s"] is None
    assert two["shared_tree"]["move_s"] > 0  # its one root copy, timed
    assert isinstance(r["shared_tree_pays"], bool) and "shared tree" in r["shared_tree_verdict"]
    # the image-move row: all 4 layers to an empty host, the 2 upper ones to a host holding
    # the lower 2, nothing to one holding it all
    full, partial, again = r["image_move"]["rows"]
    assert (full["layers_sent"], partial["layers_sent"], partial["layers_skipped"], again["layers_sent"]) == (4, 2, 2, 0)
    assert full["bytes"] > partial["bytes"] > 0 == again["bytes"] and full["seconds"] > 0
    assert not list(cfg.paths.bench.iterdir())  # the simulated hosts' homes are gone


def test_bench_cluster_bad_sizes(capsys):
    assert main(["bench", "cluster", "--hosts", "two"]) == exits.FAILED
    assert "--hosts 'two'" in capsys.readouterr().err
    assert main(["bench", "cluster", "--hosts", "0"]) == exits.FAILED
    assert "hosts, tasks and group must be >= 1" in capsys.readouterr().err
