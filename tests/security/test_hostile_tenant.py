"""A hostile tenant against the workspace's own plumbing (issue 25's smaller items).

Each test attacks from inside a real workspace, or asks the agent to do what a process
inside is refused, and asserts a clear refusal and a workspace that works afterwards.
"""

from __future__ import annotations

import os
import time

import pytest

from bunshin.agent.shellpty import CONTINUED_NOTE, MAX_SESSIONS
from bunshin.errors import InvalidArgument, PathNotFound, ResourceExhausted
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


def _wait_file(ws: Workspace, path: str) -> str:
    deadline = time.monotonic() + 10
    while ws.exec(["test", "-s", path]).exit_code:
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return ws.files.read(path).decode()


def test_file_calls_do_not_reach_the_agents_proc_entries(ws):
    """What a process inside is refused in /proc/1 (environ, memory, maps, descriptors) the
    agent's file calls refuse too, however the path gets there; the agent's log (a canary
    written through its descriptor) stays untouched."""
    ws.exec("ln -s /proc/1/environ /tmp/env; ln -s /proc/self/fd/1 /tmp/log; ln -s /proc /tmp/p; "
            "ln -s ../proc/thread-self /tmp/me")
    holder = ws.commands.spawn(["python3", "-c", "import os, time; fd = os.open('/proc/1', os.O_RDONLY); "
                                "open('/tmp/fd', 'w').write(str(fd)); time.sleep(600)"])
    fd = _wait_file(ws, "/tmp/fd")
    inside_refused = ["/proc/1/environ", "/proc/1/mem", "/proc/1/maps", "/proc/1/fd/1", "/proc/1/task/1/environ"]
    for path in inside_refused:
        r = ws.exec(["head", "-c", "1", path])
        assert r.exit_code != 0 and "Permission denied" in r.stderr, (path, r)
    for path in [*inside_refused, "/proc/self/environ", "/proc/thread-self/environ", "/tmp/env", "/tmp/log",
                 "/tmp/p/1/environ", "/tmp/me/environ", f"/proc/{holder}/fd/{fd}/environ", "/proc/1/root/etc/hostname"]:
        with pytest.raises(InvalidArgument, match="permission denied"):
            ws.files.read(path)
    for path in ("/proc/1/fd", "/proc/self/task", "/tmp/p/1/map_files"):
        with pytest.raises(InvalidArgument, match="permission denied"):
            ws.files.list(path)
    canary = f"bunshin-canary-{os.getpid()}"
    for path in ("/tmp/log", "/proc/1/fd/2", "/proc/self/comm", "/proc/1/mem"):
        with pytest.raises(InvalidArgument, match="permission denied"):
            ws.files.write(path, canary)
    assert canary not in ws.exec("cat /.bunshin/run/agent.log").stdout
    assert ws.exec("cat /proc/1/comm").stdout.strip() != canary
    ws.commands.kill(holder, 9)
    ws.files.write("/tmp/ok", "fine")
    assert ws.files.read("/tmp/ok") == b"fine" and ws.exec("echo alive").stdout == "alive\n"


def test_a_link_swapped_during_the_call_never_leads_into_the_agent(ws):
    """An attacker swaps a folder link between a harmless folder and /proc/1 as fast as it
    can: every read gets the harmless file or a refusal, never the agent's environment."""
    ws.exec("mkdir -p /tmp/harmless && echo harmless > /tmp/harmless/environ")
    swapper = ws.commands.spawn(["python3", "-c", "import os\nwhile True:\n"
                                 "    os.symlink('/tmp/harmless', '/tmp/a'); os.rename('/tmp/a', '/tmp/race')\n"
                                 "    os.symlink('/proc/1', '/tmp/b'); os.rename('/tmp/b', '/tmp/race')\n"])
    got: dict[object, int] = {}
    try:
        _wait_file(ws, "/tmp/race/environ")
        for _ in range(400):
            try:
                key: object = ws.files.read("/tmp/race/environ")
            except InvalidArgument:
                key = "refused"
            except PathNotFound:
                key = "missing"
            got[key] = got.get(key, 0) + 1
    finally:
        ws.commands.kill(swapper, 9)
    assert set(got) <= {b"harmless\n", "refused", "missing"}, got
    assert ws.files.read("/tmp/harmless/environ") == b"harmless\n"
