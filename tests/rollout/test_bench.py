"""The rollout benchmark's pieces: workloads, memory integration, summaries, the report; one tiny real run."""

from __future__ import annotations

import json

import pytest

from bunshin.bench import rollout as bench
from bunshin.bench import rollout_report, workloads
from bunshin.bench.sampler import Series, integral
from bunshin.rollout.records import Status, Timings, TrajectoryResult


def test_workloads_are_deterministic_and_branch():
    a = workloads.build("coding-lite", tasks=2, traces=8, think_scale=0.5)
    b = workloads.build("coding-lite", tasks=2, traces=8, think_scale=0.5)
    assert a == b and len(a.tasks) == 2 and len(a.traces) == 16
    firsts = {tr.steps[0].arguments["command"] for tr in a.traces}
    assert len(firsts) == 1  # a shared first call: what the prefix cache feeds on
    assert len({tuple((s.name, json.dumps(s.arguments)) for s in tr.steps) for tr in a.traces}) > 4
    d = workloads.build("data-analysis", tasks=1, traces=8, rows=1000)
    assert d.tasks[0].setup[1].tool == "python" and all(s.think_s > 0 for tr in d.traces for s in tr.steps)
    with pytest.raises(ValueError):
        workloads.build("nope", tasks=1, traces=1)


def test_integral_and_series():
    assert integral([0, 1, 2], [0, 2, 2]) == 3.0
    assert integral([0, 1], [-5, -5]) == 0.0
    s = Series(t=[0.0, 1.0, 2.0], used=[100, 300, 100], ws=[0, 10, 0])
    assert s.peak(100) == 200 and s.gb_s(100) == pytest.approx(200 / 1e9)
    assert s.ws_peak() == 10 and len(s.downsampled(1)["t"]) == 1


def _traj(mode: str, task: str, gid: str, i: int, reward: float | None) -> TrajectoryResult:
    return TrajectoryResult(run_id="r", task_id=task, group_id=gid, trajectory_id=f"{gid}-{i}", index=i, mode=mode,
                            options={}, status=Status.COMPLETED if reward is not None else Status.ERROR,
                            reward=reward, messages=[], steps=[], timings=Timings(total_s=2.0, env_s=1.0))


def _phase(mode: str, rewards: list[float | None], peak: int, makespan: float) -> bench.Phase:
    gid = f"t1-g-{mode}"
    trajs = [_traj(mode, "t1", gid, i, r) for i, r in enumerate(rewards)]
    series = Series(t=[0.0, 1.0, 2.0], used=[0, peak, 0], ws=[0, peak // 2, 0])
    return bench.Phase(mode, "coding-lite", makespan, 0, series, trajs,
                       [{"task": "t1", "group_id": gid, "n": len(rewards), "makespan_s": makespan, "prepare_s": 0,
                         "failed": 0}])


def test_summary_ratios_goals_and_reward_check(tmp_path):
    plan = bench.Plan.make(quick=True, modes=("baseline", "bunshin"), workloads=("coding-lite",))
    loads = {"coding-lite": workloads.build("coding-lite", tasks=1, traces=2)}
    r = bench.summarize(plan, [_phase("baseline", [1.0, 0.5], 1000, 10.0), _phase("bunshin", [1.0, 0.5], 200, 5.0)],
                        loads, 1.0)
    assert r["same_rewards"] and r["rewards_compared"] == 2
    assert r["modes"]["baseline"]["peak_bytes"] == 1000 and r["vs_baseline"]["bunshin"]["peak"] == 0.8
    assert r["vs_baseline"]["bunshin"]["makespan"] == 0.5 and r["goals"]["latency"]["met"]
    bad = bench.summarize(plan, [_phase("baseline", [1.0, 0.5], 1000, 10.0), _phase("bunshin", [1.0, None], 200, 5)],
                          loads, 1.0)
    assert not bad["same_rewards"] and bad["missing_rewards"]
    path = rollout_report.write(r, tmp_path / "rep")
    text = path.read_text()
    assert "| bunshin |" in text and "−80 %" not in text and "-80 %" in text
    for png in ("memory.png", "latency.png"):
        assert (tmp_path / "rep" / png).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "rep" / "results.json").read_text())["same_rewards"]
    bench.print_report(r)


def test_plan_rejects_unknown_modes():
    with pytest.raises(ValueError, match="unknown mode"):
        bench.Plan.make(quick=True, modes=("fast",))
    assert bench.Plan.make(quick=True).group_sizes == (8,)
    assert bench.Plan.make(quick=False).group_sizes == (8, 32)


@pytest.mark.integration
@pytest.mark.criu
def test_tiny_bench_runs_every_mode(no_leaks, tmp_path):
    plan = bench.Plan(modes=("baseline", "copy", "bunshin"), workloads=("coding-lite",), group_sizes=(2,), tasks=1,
                      think_scale=0.05, rows=1000, settle_s=0.1)
    r = bench.run(no_leaks, plan)
    assert r["same_rewards"], (r["reward_mismatches"], r["missing_rewards"])
    assert all(m["failed"] == 0 and m["trajectories"] == 2 for m in r["modes"].values())
    assert all(m["peak_bytes"] is not None and m["makespan_s"] > 0 for m in r["modes"].values())
    rollout_report.write(r, tmp_path)
    assert (tmp_path / "memory.png").exists()


def test_coding_workload_uses_the_cache_benchmark_calls():
    from bunshin.bench import cache as cache_bench
    from bunshin.bench.workloads import coding

    t = coding.task(1)
    trs = coding.traces(t, 8, seed=0, think_scale=1.0)
    assert len(trs) == 8 and all(tr.task == "code-1" for tr in trs)
    assert [(s.name, s.arguments) for s in trs[0].steps[:len(cache_bench.PREFIX)]] == \
        [(n, a) for n, a in cache_bench.PREFIX]
    assert t.workdir == cache_bench.TASK and "unittest" in t.reward.command


@pytest.mark.integration
def test_home_memory_sees_a_workspace(no_leaks):
    from bunshin.bench.sampler import HomeMemory
    from bunshin.workspace import Workspace

    home = HomeMemory(no_leaks)
    before = home.cgroups()
    with Workspace.create("host", memory="512M", config=no_leaks) as ws:
        ws.exec("python3 -c 'import time; b = bytearray(64 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
                "open(\"/tmp/done\", \"w\").close(); time.sleep(30)' & while [ ! -e /tmp/done ]; do sleep 0.05; done",
                timeout=20)
        assert home.cgroups() - before > 60 << 20
