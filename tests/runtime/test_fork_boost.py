"""The pre-copying threads in a CPU cgroup of their own, weighed up, for a bounded time (``runtime/fork_boost``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime.criu import fork_boost


def test_the_factor_comes_from_the_environment_and_a_malformed_one_is_refused(monkeypatch):
    monkeypatch.delenv(fork_boost.ENV, raising=False)
    assert fork_boost.factor() == fork_boost.FACTOR
    for text, want in (("1", 1), ("0", 1), ("3", 3), ("", fork_boost.FACTOR)):
        monkeypatch.setenv(fork_boost.ENV, text)
        assert fork_boost.factor() == want
    for bad in ("x", "-2", "1.5", " 8"):
        monkeypatch.setenv(fork_boost.ENV, bad)
        with pytest.raises(InvalidArgument, match=fork_boost.ENV) as e:
            fork_boost.factor()
        assert "0 to fork at the default weight" in (e.value.hint or "")


@pytest.fixture
def cpu_root():
    root = fork_boost.cpu_root()
    if root is None:
        pytest.skip("no cgroup v1 CPU hierarchy here: nothing is boosted (cgroup v2 moves processes, not threads)")
    return root


def _mine(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(f"{fork_boost.PREFIX}{os.getpid()}."))


def _in_thread(fn):
    """``fn()`` in a fresh thread (each test thread starts where the test process is), its result or error."""
    out: list[object] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.integration
def test_the_thread_and_what_it_starts_weigh_more_inside_and_go_back_after(cpu_root):
    def body():
        tid = threading.get_native_id()
        before = fork_boost.thread_cgroup(tid)
        seen = {}
        with fork_boost.boosted(4) as boost:
            assert boost is not None
            seen["own"] = fork_boost.thread_cgroup(tid)
            seen["shares"] = int((boost.path / "cpu.shares").read_text())
            inner: list[str | None] = []
            t = threading.Thread(target=lambda: inner.append(fork_boost.thread_cgroup(threading.get_native_id())))
            t.start()
            t.join()
            seen["thread"] = inner[0]
            child = subprocess.run([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"],
                                   capture_output=True, text=True, check=True).stdout
            seen["child"] = [ln.split(":", 2)[2] for ln in child.split() if "cpu" in ln.split(":")[1].split(",")]
            seen["tasks"] = fork_boost._tasks(boost.path)
            seen["path"] = boost.path
        return before, seen, fork_boost.thread_cgroup(tid), tid

    before, seen, after, tid = _in_thread(body)
    name = f"/{fork_boost.PREFIX}{os.getpid()}.{tid}"
    assert seen["own"] == name and seen["thread"] == name and seen["child"] == [name]
    assert seen["shares"] == 4 * fork_boost.DEFAULT_SHARES
    assert seen["tasks"] == [tid]  # only the thread itself: nothing else was ever moved in
    assert after == before  # back where it was (the kernel's autogroup applies there again)
    assert not seen["path"].exists() and _mine(cpu_root) == []


@pytest.mark.integration
def test_a_failure_inside_puts_everything_back(cpu_root):
    def body():
        tid = threading.get_native_id()
        before = fork_boost.thread_cgroup(tid)
        with pytest.raises(ZeroDivisionError), fork_boost.boosted(8):
            assert fork_boost.thread_cgroup(tid) != before
            _ = 1 // 0
        return before, fork_boost.thread_cgroup(tid)

    before, after = _in_thread(body)
    assert after == before and _mine(cpu_root) == []


@pytest.mark.integration
def test_the_boost_ends_by_itself_after_its_budget(cpu_root):
    def body():
        tid = threading.get_native_id()
        before = fork_boost.thread_cgroup(tid)
        with fork_boost.boosted(8, budget_s=0.2) as boost:
            assert boost is not None and fork_boost.thread_cgroup(tid) != before
            deadline = time.monotonic() + 10
            while not boost.ended and time.monotonic() < deadline:
                time.sleep(0.02)
            inside = fork_boost.thread_cgroup(tid), boost.timed_out, boost.path.exists()
            # a thread started after the budget is not boosted either
            late: list[str | None] = []
            t = threading.Thread(target=lambda: late.append(fork_boost.thread_cgroup(threading.get_native_id())))
            t.start()
            t.join()
        return before, inside, late[0]

    before, (own, timed_out, exists), late = _in_thread(body)
    assert own == before and timed_out and not exists and late == before
    assert _mine(cpu_root) == []


def test_factor_one_boosts_nothing(monkeypatch):
    monkeypatch.setenv(fork_boost.ENV, "0")

    def body():
        tid = threading.get_native_id()
        before = fork_boost.thread_cgroup(tid)
        with fork_boost.boosted() as boost:
            return boost, before, fork_boost.thread_cgroup(tid)

    boost, before, inside = _in_thread(body)
    assert boost is None and inside == before


@pytest.mark.integration
def test_a_boost_cgroup_a_dead_process_left_is_swept(cpu_root):
    p = subprocess.Popen(["true"])
    p.wait()
    stale = cpu_root / f"{fork_boost.PREFIX}{p.pid}.{p.pid}"
    if os.path.exists(f"/proc/{p.pid}"):
        pytest.skip("the pid was reused at once")
    stale.mkdir()
    try:
        def body():
            with fork_boost.boosted(2) as boost:
                return boost is not None

        assert _in_thread(body)
        assert not stale.exists()
    finally:
        if stale.exists():
            _rmdir(stale)


@pytest.mark.integration
def test_the_boost_cgroup_is_a_child_of_the_threads_own_so_the_hosts_bounds_on_it_hold(cpu_root):
    """Run from a service's cgroup (made here, with a CPU quota), the boost sits beneath it:
    the quota still bounds the boosted threads, and they go back into it after."""
    service = cpu_root / f"test-service.bunshin.{os.getpid()}"  # (not a workspace's prefix: no gc takes it)
    service.mkdir()
    try:
        (service / "cpu.cfs_quota_us").write_text("50000")

        def body():
            tid = threading.get_native_id()
            (service / "tasks").write_text(str(tid))
            try:
                with fork_boost.boosted(8) as boost:
                    assert boost is not None
                    inside = boost.path.parent, fork_boost.thread_cgroup(tid)
                return inside, fork_boost.thread_cgroup(tid)
            finally:
                (cpu_root / "tasks").write_text(str(tid))

        (parent, own_inside), after = _in_thread(body)
        seen = (parent, own_inside, after)
        assert parent == service and own_inside is not None and own_inside.startswith(f"/{service.name}/"), seen
        assert after == f"/{service.name}", seen
        assert [p.name for p in service.iterdir() if p.is_dir()] == []  # removed after
    finally:
        _rmdir(service)


def _rmdir(path) -> None:
    """Remove a cgroup folder this test made (a task that just left may keep it busy a moment)."""
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
    path.rmdir()
