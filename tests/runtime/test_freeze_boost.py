"""Real-time priority for the freeze: given, put back, and never for longer than its budget."""

from __future__ import annotations

import os
import threading
import time

import pytest

from bunshin.runtime import freeze_boost

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
