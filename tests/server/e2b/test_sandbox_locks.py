"""The E2B per-id locks (sandboxes, templates): one holder at a time, none kept for an id nobody holds."""

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
    assert len(sb._locks) == 0


def test_a_made_up_template_leaves_no_lock(tmp_path):
    import pytest

    from bunshin.errors import NotFound
    from bunshin.server.e2b.templates import Templates

    t = Templates(Config.for_home(tmp_path))
    for i in range(3):
        with pytest.raises(NotFound):
            t.snapshot_of(f"no-such-template-{i}")
    assert len(t._locks) == 0
