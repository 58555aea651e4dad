"""Dumps over CRIU's RPC socket (``criu.dump(notify=...)``): options, notification handlers
run while the tasks are frozen, a handler that fails, criu in the tree's time namespace;
and a descriptor the warm helper passes on to its command."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime.criu import prepared
from bunshin.runtime.criu import run as criu
from bunshin.runtime.criu import swrk as criu_swrk
from bunshin.runtime.criu.zygote import PASSED_FD
from bunshin.runtime.snapshot import taking as rsnap_taking

from .test_criu import COUNTER, Counters, criu_bin, workdir  # noqa: F401 (fixtures)


def _state(pid: int) -> str:
    return next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("State:"))


def test_the_options_of_a_snapshot_become_the_requests_fields():
    r = criu_swrk.rpc()
    flags = ["--leave-running", *rsnap_taking._COMMON, *rsnap_taking.DUMP_EXTERNAL, "--manage-cgroups=ignore",
             "--ghost-limit", "123", "--external", "mnt[/a b]:bunshin-mnt-0", "--network-lock", "nftables"]
    o = criu_swrk.request(7, 42, "dump.log", flags).opts
    assert (o.images_dir_fd, o.pid, o.log_file, o.log_level, o.notify_scripts) == (7, 42, "dump.log", 4, True)
    assert o.leave_running and o.file_locks and o.tcp_established and o.link_remap
    assert o.network_lock == r.NFTABLES and o.manage_cgroups and o.manage_cgroups_mode == r.IGNORE
    assert criu_swrk.request(7, 42, "dump.log", ["--network-lock", "skip"]).opts.network_lock == r.SKIP
    assert o.ghost_limit == 123 and list(o.external) == ["mnt[/sys]:bunshin-sys", "mnt[/a b]:bunshin-mnt-0"]


def test_an_option_without_a_field_or_a_value_is_refused():
    with pytest.raises(InvalidArgument, match="--action-script") as e:
        criu_swrk.request(7, 42, "dump.log", ["--action-script", "/x.sh"])
    assert "criu/swrk.py" in e.value.hint
    with pytest.raises(InvalidArgument, match="needs a value"):
        criu_swrk.request(7, 42, "dump.log", ["--ghost-limit"])
    with pytest.raises(InvalidArgument, match="below 4 GiB") as e:
        criu_swrk.request(7, 42, "dump.log", ["--ghost-limit", str(8 << 30)])
    assert "BUNSHIN_GHOST_LIMIT" in e.value.hint
    with pytest.raises(InvalidArgument, match="--network-lock maybe"):
        criu_swrk.request(7, 42, "dump.log", ["--network-lock", "maybe"])


@pytest.fixture
def timed(criu_bin: Path, workdir: Path) -> Iterator[Counters]:  # noqa: F811
    """Counters, each alone in a pid namespace and a time namespace of its own."""
    c = Counters(workdir)
    yield c
    c.close()


def _spawn_in_own_time(c: Counters) -> int:
    p = subprocess.Popen(["unshare", "--pid", "--time", "--fork", sys.executable, "-c", COUNTER, str(c.out)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True, cwd=c.out)  # ./proc.crtools: its own
    c.popens.append(p)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        if kids:
            c.pids.append(int(kids[0]))
            c.value(int(kids[0]))
            return int(kids[0])
        time.sleep(0.01)
    raise TimeoutError("counter did not start")


@pytest.mark.criu
def test_handlers_run_at_their_stage_and_criu_reads_the_trees_clocks_itself(timed, criu_bin, workdir):  # noqa: F811
    pid = _spawn_in_own_time(timed)
    assert os.readlink(f"/proc/{pid}/ns/time") != os.readlink("/proc/self/ns/time")
    seen: dict[str, object] = {}
    run = criu.dump(criu_bin, pid, workdir / "img", extra=[*rsnap_taking._COMMON],
                    notify={"pre-dump": lambda: seen.update({"pre-dump": _state(pid),
                                                             "policy": os.sched_getscheduler(0)}),
                            "post-dump": lambda: seen.setdefault("post-dump", _state(pid))})
    assert seen["pre-dump"] in ("S", "R") and seen["post-dump"] == "t"  # frozen (ptrace-stopped) at post-dump
    # boosted from pre-dump on (for at most freeze_boost's budget: on a busy machine a dump
    # outlasts it, so post-dump may already be back at the normal policy), and back after
    assert seen["policy"] == os.SCHED_FIFO and os.sched_getscheduler(0) == os.SCHED_OTHER
    log = run.log.read_text()
    assert "Dumping finished successfully" in log
    assert "Will take time namespace" not in log and "Dump TIME namespace" not in log  # no dumper forked into it
    assert (workdir / "img" / "timens-0.img").exists()  # the tree's clocks, read by criu in its namespace
    before = timed.value(pid)
    assert timed.wait_above(pid, before)  # it kept running
    r = criu.restore(criu_bin, workdir / "img", pidfile=workdir / "clone.pid")
    assert r.pid is not None
    timed.pids.append(r.pid)
    assert timed.wait_above(r.pid, 0)


@pytest.mark.criu
def test_a_failing_handler_fails_the_dump_and_leaves_the_tree_running(timed, criu_bin, workdir):  # noqa: F811
    pid = _spawn_in_own_time(timed)

    def broken() -> None:
        raise RuntimeError("the copy went wrong")

    children_before = set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())
    with pytest.raises(RuntimeError, match="the copy went wrong"):
        criu.dump(criu_bin, pid, workdir / "img", extra=[*rsnap_taking._COMMON], notify={"post-dump": broken})
    assert _state(pid) != "t"
    before = timed.value(pid)
    assert timed.wait_above(pid, before)
    children_after = set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())
    assert children_after <= children_before  # criu is gone
    with pytest.raises(InvalidArgument):  # refused before anything starts
        criu.dump(criu_bin, pid, workdir / "img2", extra=["--no-such-option"], notify={})


@pytest.mark.integration
def test_the_helper_passes_one_descriptor_on_as_fd_3():
    r, w = os.pipe()
    try:
        with tempfile.TemporaryFile() as out:
            started = prepared.start(["/bin/sh", "-c", f"echo through >&{PASSED_FD}; ls /proc/self/fd"], None,
                                     out.fileno(), pass_fd=w)
            assert started is not None, "the launcher did not start"
            os.close(w)
            w = -1
            assert started.wait(10) == 0
            assert os.read(r, 100) == b"through\n"
            out.seek(0)
            assert sorted(out.read().decode().split()) == ["0", "1", "2", "3", "4"]  # 4: ls's own listing
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
