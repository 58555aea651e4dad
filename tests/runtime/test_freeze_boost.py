"""Real-time priority for the freeze: given, put back, and never for longer than its budget."""

from __future__ import annotations

import os
import struct
import threading
import time

import pytest

from bunshin.runtime.criu import freeze_boost

pytestmark = pytest.mark.integration  # needs CAP_SYS_NICE (root)


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


def test_boosted_then_put_back():
    me = threading.get_native_id()
    before = (_policy(me), os.sched_getparam(me).sched_priority)
    boost = freeze_boost.Boost((me, 2**22 + 999))  # the second never existed: skipped
    boost.start()
    try:
        assert _policy(me) == os.SCHED_FIFO and os.sched_getparam(me).sched_priority == freeze_boost.PRIORITY
        assert boost.boosted == (me,)
    finally:
        boost.stop()
    assert (_policy(me), os.sched_getparam(me).sched_priority) == before and boost.boosted == ()
    boost.stop()  # twice is fine


def test_the_budget_ends_the_boost_by_itself():
    me = threading.get_native_id()
    boost = freeze_boost.Boost((me,), budget_s=0.05)
    boost.start()
    assert _policy(me) == os.SCHED_FIFO
    deadline = time.monotonic() + 5
    while _policy(me) == os.SCHED_FIFO and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _policy(me) == os.SCHED_OTHER and boost.boosted == ()


def _latency_target() -> int:
    fd = os.open(freeze_boost.LATENCY_DEVICE, os.O_RDONLY)
    try:
        return struct.unpack("i", os.read(fd, 4))[0]
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.exists(freeze_boost.LATENCY_DEVICE), reason="no /dev/cpu_dma_latency")
def test_latency_request_held_while_boosted_and_gone_after():
    me = threading.get_native_id()
    boost = freeze_boost.Boost((me,), latency=True)
    boost.start()
    try:
        assert boost.holds_latency and _latency_target() == 0  # idle CPUs poll now
    finally:
        boost.stop()
    assert not boost.holds_latency
    # the request went with its descriptor (another dump on this machine may hold its own)
    assert all(not link.endswith("cpu_dma_latency") for link in _my_fd_targets())
    plain = freeze_boost.Boost((me,))
    plain.start()
    try:
        assert not plain.holds_latency
    finally:
        plain.stop()


def test_latency_budget_ends_the_request_too():
    me = threading.get_native_id()
    boost = freeze_boost.Boost((me,), budget_s=0.05, latency=True)
    boost.start()
    deadline = time.monotonic() + 5
    while boost.holds_latency and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not boost.holds_latency


def test_hold_latency_refused_is_minus_one(tmp_path):
    assert freeze_boost.hold_latency(str(tmp_path / "missing")) == -1


def _my_fd_targets() -> list[str]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            pass
    return out


def _budget_threads() -> int:
    return sum(t.name == "bunshin-boost-budget" for t in threading.enumerate())


def test_an_armed_boost_starts_no_thread_at_start_and_its_budget_still_ends_it():
    """``arm`` (before the dump) starts the budget's timer; ``start`` (CRIU's pre-dump, just before the
    freeze) only wakes it: a thread starting there held the GIL the next notification's answer needed."""
    me = threading.get_native_id()
    before = _budget_threads()
    boost = freeze_boost.Boost((me,), budget_s=0.05)
    boost.arm()
    boost.arm()  # once
    assert _budget_threads() == before + 1 and _policy(me) == os.SCHED_OTHER  # armed, not boosted
    started = threading.active_count()
    boost.start()
    assert threading.active_count() == started and _policy(me) == os.SCHED_FIFO
    deadline = time.monotonic() + 5
    while (_policy(me) == os.SCHED_FIFO or _budget_threads() > before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _policy(me) == os.SCHED_OTHER and _budget_threads() == before  # put back, its thread gone


def test_a_boost_armed_but_never_started_ends_its_thread_at_stop():
    me = threading.get_native_id()
    before = _budget_threads()
    boost = freeze_boost.Boost((me,))
    boost.arm()
    boost.stop()  # a dump that failed before its pre-dump stage
    deadline = time.monotonic() + 5
    while _budget_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _budget_threads() == before
    boost.start()  # stopped: not boosted again
    assert _policy(me) == os.SCHED_OTHER and boost.boosted == ()
