"""``bunshin bench restore-phases``: a restore's log split at CRIU's markers, on real restores."""

from __future__ import annotations

import pytest

from bunshin.bench import restore_phases
from bunshin.errors import InvalidArgument

LOG = """\
Warn  (criu/config.c:1063): --network-lock will be ignored in restore command
(00.000019) Version: 4.2.1 (gitid 0)
(00.001695) Forking task with 1 pid (flags 0x3c020000)
(00.010012) Running post-setup-namespaces scripts
(00.021635) uns: calling exit_usernsd (-1, 1)
(00.022199) uns: daemon stopped
(00.025888) Restore finished successfully. Tasks resumed.
"""


def test_parse_splits_at_the_markers_in_order():
    r = restore_phases.parse(LOG)
    assert r is not None and r.span_ms == pytest.approx(25.888)
    assert r.phases_ms == pytest.approx({"setup": 1.695, "namespaces": 8.317, "tasks": 11.623, "finish": 4.253})
    assert sum(r.phases_ms.values()) == pytest.approx(r.span_ms)


def test_an_unfinished_restore_has_no_phases_and_bad_arguments_say_what_to_pass():
    assert restore_phases.parse(LOG.replace("Restore finished successfully", "Restoring FAILED")) is None
    assert restore_phases.parse("") is None
    with pytest.raises(InvalidArgument, match="clones >= 1") as e:
        restore_phases.run(None, clones=0)  # type: ignore[arg-type]
    assert "--clones" in (e.value.hint or "")


@pytest.mark.integration
@pytest.mark.criu
def test_a_tiny_run_splits_every_real_restore_and_leaves_no_log(no_leaks):
    r = restore_phases.run(no_leaks, clones=3, heap_mib=16)
    s = r["all"]
    assert r["restore_ms_p50"] > 0 and set(r["phases_ms_p50"]) == set(restore_phases.PHASES)
    assert all(v > 0 for v in r["phases_ms_p50"].values())
    assert s["log_span_ms"]["p50"] <= s["restore_ms"]["p50"] and r["outside_ms_p50"] > 0
    assert set(r["steps_ms_p50"]) == {"prepare", "criu_call", "after"}
    assert [b["alive_before"] for b in r["batches"]] == [0]
    cpu = r["cpu_ms_per_clone"]
    assert set(cpu) == {"bunshin", "helper", "clones", "total"} and cpu == r["batches"][0]["cpu_ms_per_clone"]
    assert cpu["bunshin"] > 0 and cpu["helper"] > 0 and cpu["clones"] > 0  # each part measured
    assert cpu["total"] == pytest.approx(cpu["bunshin"] + cpu["helper"] + cpu["clones"], abs=0.02)


def test_the_cpu_split_is_per_clone_and_adds_up():
    split = restore_phases.cpu_split(restore_phases.CpuMark(1.0, 2.0), restore_phases.CpuMark(1.012, 2.004), 0.064, 4)
    assert split == {"bunshin": 3.0, "helper": 1.0, "clones": 16.0, "total": 20.0}
