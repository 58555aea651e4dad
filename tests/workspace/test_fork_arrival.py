"""Integration: a fork that reports success gives clones whose processes run (issue 30).

``restore_check``: a restored process that dies by a signal right after its restore
fails the whole batch (no clone is left), named by its pid, command line and signal;
one that exits normally does not (it may have finished), nor a zombie of the dump; one
stopped that ran when dumped fails it too, one stopped in the parent does not; so does
one hung in uninterruptible sleep, not running, for ``HUNG_S``.
``progs/arrival.c`` dies (or stops) only once it finds itself in another pid namespace,
i.e. in a clone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin.errors import RuntimeFailure
from bunshin.runtime.state.store import Store
from bunshin.workspace import Workspace
from tests.workspace.test_fork import wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"


@pytest.fixture(scope="module")
def arrival(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("arrival") / "arrival"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(PROGS / "arrival.c")], check=True)
    return out.read_bytes()


def start(ws: Workspace, binary: bytes, how: str) -> int:
    ws.files.write("/root/arrival", binary, mode=0o755)
    assert ws.exec(["mkdir", "-p", "/tmp/arr"]).exit_code == 0
    ws.commands.spawn(["/root/arrival", how, "/tmp/arr"])
    return int(wait_file(ws, "/tmp/arr/ready"))


def test_a_process_killed_on_arrival_fails_the_fork_naming_it(family, arrival):
    ws = family.create()
    pid = start(ws, arrival, "segv")
    with Store.open(family.cfg.db_path) as store:
        before = {w.id for w in store.list_workspaces()}
    with pytest.raises(RuntimeFailure) as err:
        family.fork(ws, 2)
    assert f"process {pid} (/root/arrival segv /tmp/arr)" in err.value.message
    assert "signal 11 (SIGSEGV)" in err.value.message
    assert {d["signal"] for d in err.value.details["dead"]} == {11}
    assert err.value.hint
    with Store.open(family.cfg.db_path) as store:  # all or none: no clone is left
        assert {w.id for w in store.list_workspaces()} == before
    assert ws.exec(["kill", "-0", str(pid)]).exit_code == 0  # the parent's runs on


def test_a_process_that_exits_normally_on_arrival_is_no_failure(family, arrival):
    ws = family.create()
    pid = start(ws, arrival, "exit")
    (c,) = family.fork(ws, 1)
    assert c.exec(["true"]).exit_code == 0
    assert c.exec(["kill", "-0", str(pid)]).exit_code != 0  # it did exit there
    assert ws.exec(["kill", "-0", str(pid)]).exit_code == 0
    assert c.record.extra["restore_check_ms"] >= 0
    assert c.record.extra["restore_check_tasks"] >= 2  # the agent and its threads, the shell...
    assert c.record.extra["restore_check_us_per_task"] > 0 and c.record.extra["restore_check_watch_cpu_ms"] > 0


def test_a_process_that_stops_on_arrival_fails_the_fork_one_stopped_before_does_not(family, arrival):
    ws = family.create()
    pid = start(ws, arrival, "stop")
    with pytest.raises(RuntimeFailure) as err:
        family.fork(ws, 1)
    assert f"process {pid} (/root/arrival stop /tmp/arr) of clone" in err.value.message
    assert "is stopped right after its restore" in err.value.message
    assert err.value.details["dead"][0]["stopped"] is True
    assert ws.exec(["kill", "-STOP", str(pid)]).exit_code == 0  # stopped before the fork: stays so
    (c,) = family.fork(ws, 1)
    assert c.exec(["sh", "-c", f"grep '^State:' /proc/{pid}/status"]).stdout.split()[1] == "T"


def test_a_process_hung_on_arrival_fails_the_fork_naming_it(family, arrival):
    ws = family.create()
    pid = start(ws, arrival, "hang")
    with pytest.raises(RuntimeFailure) as err:
        family.fork(ws, 1)
    assert f"process {pid} (/root/arrival hang /tmp/arr) of clone" in err.value.message
    assert f"is hung right after its restore: thread {pid} in uninterruptible sleep" in err.value.message
    assert "did not run for 1 s" in err.value.message
    assert err.value.details["dead"][0]["hung"].startswith(f"thread {pid} ")
    assert ws.exec(["kill", "-0", str(pid)]).exit_code == 0  # the parent's runs on, not hung
    assert ws.exec(["grep", "^State:", f"/proc/{pid}/status"]).stdout.split()[1] != "D"


def test_a_zombie_killed_by_a_signal_before_the_fork_is_no_failure(family):
    ws = family.create()
    code = ("import signal, subprocess, time\n"
            "p = subprocess.Popen(['sleep', '600'])\n"
            "p.send_signal(signal.SIGSEGV)\n"  # never waited for: a zombie killed by SIGSEGV
            "open('/tmp/zombie', 'w').write(str(p.pid))\n"
            "time.sleep(600)\n")
    ws.commands.spawn(["python3", "-c", code])
    zombie = int(wait_file(ws, "/tmp/zombie"))
    r = ws.exec(["sh", "-c", f"while ! grep -q '^State:.Z' /proc/{zombie}/status; do sleep 0.02; done"], timeout=20)
    assert r.exit_code == 0
    (c,) = family.fork(ws, 1)
    assert c.exec(["grep", "^State:", f"/proc/{zombie}/status"]).stdout.split()[1] == "Z"
