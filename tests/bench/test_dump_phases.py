"""The dump's pause split at CRIU's markers: a written log, then real delta dumps."""

from __future__ import annotations

import pytest

from bunshin.bench import dump_phases
from bunshin.errors import InvalidArgument

# the marker lines of a two-process dump (CRIU 4.2.1, -v4), other lines between them
LOG = """\
(00.001279) Running pre-dump scripts
(00.002000) Detected cgroup V1 freezer
(00.002100) \tSeizing 12756's 12759 thread
(00.004000) sockets: Sockets collect procedure family AF_INET proto IPPROTO_RAW: -2
(00.006000) Dumping task (pid: 12756 comm: ld-linux-x86-64)
(00.008000) Set up parasite blob using memfd
(00.008500) Dumping pages (type: 59 pid: 12756)
(00.010000) Dumping task cwd id 0x20 root id 0x21
(00.010100) Dumping task (pid: 12760 comm: bash)
(00.011100) Set up parasite blob using memfd
(00.011300) Dumping pages (type: 59 pid: 12760)
(00.012300) Dumping task cwd id 0x39 root id 0x3a
(00.012400) Dumping pstree (pid: 12756)
(00.014000) Running post-dump scripts
(00.017000) Unfreezing tasks into 1
(00.017100) Writing stats
"""


def test_a_log_is_split_per_phase_summed_over_tasks():
    split = dump_phases.parse(LOG)
    assert split is not None and split.frozen_ms == pytest.approx(15.0)
    want = {"seize": 4.0, "task": 2.0 + 1.0, "parasite": 0.5 + 0.2, "pages": 1.5 + 1.0,
            "tree": 0.1 + 1.7, "post_dump": 3.0}
    assert split.phases_ms == pytest.approx(want)
    assert sum(split.phases_ms.values()) == pytest.approx(split.frozen_ms)
    assert split.threads == 1  # 12756's 12759


def test_p90_of_one_or_more_values():
    assert dump_phases._p90([7.0]) == 7.0
    assert dump_phases._p90([float(x) for x in range(1, 11)]) == pytest.approx(9.1)


def test_a_log_without_a_thaw_or_a_freeze_gives_none():
    assert dump_phases.parse(LOG.replace("Unfreezing tasks", "Dumping FAILED")) is None
    assert dump_phases.parse("\n".join(ln for ln in LOG.splitlines() if "freezer" not in ln
                                       and "Seizing" not in ln)) is None
    assert dump_phases.parse("") is None


@pytest.mark.integration
@pytest.mark.criu
def test_delta_dumps_are_split_and_add_up_to_the_pause(no_leaks):
    r = dump_phases.run(no_leaks, forks=2)
    assert len(r["rounds"]) == 2 and r["pause_ms_p50"] > 0
    assert r["pause_ms_p50"] <= r["pause_ms_p90"] <= r["pause_ms_max"] and 0 <= r["over_goal"] <= 2
    assert len(r["load_1m"]) == 2 and all(x >= 0 for x in r["load_1m"])  # the load it was measured at
    for rnd in r["rounds"]:
        phases = rnd["phases_ms"]
        assert set(phases) == set(dump_phases.PHASES) and all(v > 0 for v in phases.values())
        assert sum(phases.values()) == pytest.approx(rnd["frozen_ms_in_log"], abs=0.01)
        # the log's freeze-to-thaw holds CRIU's own frozen_time, which starts once every task is seized
        # (within the seize phase: on a busy machine seizing alone takes milliseconds)
        assert rnd["traced_pause_ms"] <= rnd["frozen_ms_in_log"] + 1.0
        assert rnd["frozen_ms_in_log"] <= rnd["traced_pause_ms"] + phases["seize"] + 1.0
        assert rnd["pause_ms"] > 0  # the other dump of the round, at the configured log level
        # a delta: CRIU wrote what the fork changed since its restore (a few hundred pages), not its memory
        assert 0 < rnd["pages"] < 4096 and rnd["tasks_wait_ms"] >= 0
        # the agent's reaper and the session's pty reader: its waiting pool threads ended before the freeze
        assert rnd["threads"] == 2
    assert r["log_level"] == no_leaks.dump_log_level


@pytest.mark.integration
def test_no_forks_is_refused(no_leaks):
    with pytest.raises(InvalidArgument, match="at least 1"):
        dump_phases.run(no_leaks, forks=0)
