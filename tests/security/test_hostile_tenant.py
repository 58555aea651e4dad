"""A hostile tenant against the workspace's own plumbing (issue 25's smaller items).

Each test attacks from inside a real workspace, or asks the agent to do what a process
inside is refused, and asserts a clear refusal and a workspace that works afterwards.
"""

from __future__ import annotations

import time

import pytest

from bunshin.agent.shellpty import CONTINUED_NOTE, MAX_SESSIONS
from bunshin.errors import ResourceExhausted
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration]


@pytest.fixture
def ws(no_leaks):
    w = Workspace.create("host", memory="256M", config=no_leaks)  # the default pids limit (512)
    try:
        yield w
    finally:
        w.remove()


def test_a_thousand_sessions_stop_at_the_cap_and_the_workspace_works(ws):
    opened, refused = [], None
    for _ in range(1000):
        try:
            opened.append(ws.sessions.open())
        except ResourceExhausted as exc:
            refused = exc
            break
    assert refused is not None and len(opened) == MAX_SESSIONS
    assert f"at most {MAX_SESSIONS}" in refused.message and "close sessions" in (refused.hint or "")
    assert ws.exec("echo alive").stdout == "alive\n"  # threads and pids are left for calls
    assert ws.exec("sleep 0 & wait; echo forked").stdout == "forked\n"
    assert len(ws.sessions.list()) == MAX_SESSIONS
    ws.sessions.close(opened.pop())
    with ws.shell() as s:  # a closed session makes room
        assert s.run("echo ok").output == "ok\n"


def test_kill_stop_of_the_sessions_shell_does_not_wedge_it(ws):
    with ws.shell() as s:
        s.run("KEEP=me")
        started = time.monotonic()
        r = s.run("kill -STOP $$; echo after", timeout=30)
        assert time.monotonic() - started < 10
        assert (r.output, r.exit_code, r.timed_out, r.alive) == ("after\n" + CONTINUED_NOTE, 0, False, True)
        assert s.run("echo $KEEP", timeout=30).output == "me\n"
        assert ws.exec("ps -o stat= -p 1").exit_code == 0  # the workspace answers as before
