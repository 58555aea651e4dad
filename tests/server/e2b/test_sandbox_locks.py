"""The E2B sandboxes' per-id locks: one holder at a time, and none kept for an id nobody holds."""

from __future__ import annotations

import threading
import time

from bunshin.config import Config
from bunshin.server.e2b.sandboxes import Sandboxes


def test_a_lock_serializes_its_holders_and_goes_with_the_last(tmp_path):
    sb = Sandboxes(Config.for_home(tmp_path))
    inside, order = threading.Event(), []

    def first() -> None:
        with sb.held("ws-0123456789ab"):
            inside.set()
            time.sleep(0.2)
            order.append("first")

    t = threading.Thread(target=first)
    t.start()
    inside.wait(5)
    with sb.held("ws-0123456789ab"):
        order.append("second")
    t.join()
    assert order == ["first", "second"]
    for i in range(100):  # ids a client made up: nothing stays behind
        with sb.held(f"no-such-sandbox-{i}"):
            pass
    try:
        with sb.held("ws-0123456789ab"):
            raise KeyError("a failed call")
    except KeyError:
        pass
    assert sb._locks == {}
