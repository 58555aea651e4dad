"""A hostile tenant against the workspace's own plumbing (issue 25's smaller items).

Each test attacks from inside a real workspace, or asks the agent to do what a process
inside is refused, and asserts a clear refusal and a workspace that works afterwards.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bunshin.agent.shellpty import CONTINUED_NOTE, MAX_SESSIONS
from bunshin.errors import AgentError, InvalidArgument, PathNotFound, ResourceExhausted
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
    sid = ws.sessions.open("sh")  # dash: no job control, it would wait on a stopped command for ever
    r = ws.sessions.run(sid, "sh -c 'kill -STOP $$'; echo after", timeout=30)
    assert (r.output, r.exit_code, r.timed_out) == ("after\n" + CONTINUED_NOTE, 0, False)
    assert ws.sessions.run(sid, "echo next", timeout=30).output == "next\n"
    ws.sessions.close(sid)
    assert ws.exec("ps -eo stat= | grep -c '^T'; true").stdout.strip() == "0"  # nothing left stopped


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
        deadline = time.monotonic() + 10
        while ws.exec(["test", "-L", "/tmp/race"]).exit_code:
            assert time.monotonic() < deadline, "the swapper did not start"
            time.sleep(0.05)
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


IMPOSTOR = """import os, socket, time
os.unlink('/.bunshin/run/agent.sock')
s = socket.socket(socket.AF_UNIX)
s.bind('/.bunshin/run/agent.sock')
s.listen()
open('/tmp/impostor.ready', 'w').write('1')
time.sleep(600)
"""


@pytest.mark.parametrize("attack", [
    "rm /.bunshin/run/agent.sock",
    "rm -rf /.bunshin/run/*",  # the folder itself is not the workspace's to remove
    "rm /.bunshin/run/agent.sock && ln -s /tmp/elsewhere.sock /.bunshin/run/agent.sock",
    "rm /.bunshin/run/agent.sock && mkdir /.bunshin/run/agent.sock",
])
def test_the_agent_re_creates_a_socket_removed_from_inside(ws, attack):
    pid1 = ws.record.pid
    assert ws.exec(["sh", "-c", attack]).exit_code == 0
    assert ws.exec("echo alive").stdout == "alive\n"  # the call that found it gone asked the agent
    assert ws.agent().ping().pid == 1 and ws.record.pid == pid1
    assert ws.exec("test -S /.bunshin/run/agent.sock && echo socket").stdout == "socket\n"
    (clone,) = ws.fork(1)  # the re-created socket is dumped and restored like the first
    try:
        assert clone.exec("echo clone").stdout == "clone\n"
    finally:
        clone.remove()


def test_a_socket_replaced_from_inside_is_taken_back(ws):
    """An impostor that binds the agent's socket name is never talked to (SO_PEERCRED is
    not pid 1); the agent takes its name back and the call reaches the agent."""
    impostor = ws.commands.spawn(["python3", "-c", IMPOSTOR])
    _wait_file(ws, "/tmp/impostor.ready")
    assert ws.exec("echo alive").stdout == "alive\n"
    assert ws.agent().ping().pid == 1
    ws.commands.kill(impostor, 9)


def test_a_stopped_agent_that_cannot_re_create_its_socket_is_a_clear_error(ws):
    """The failure path: the agent cannot answer the request to re-create (stopped here, from
    the host): the call fails naming what happened and what to do; once it runs again, the
    pending request is served and the workspace works."""
    os.kill(ws.record.pid, 19)  # SIGSTOP: forced from the host
    try:
        # removed while it is stopped (removed by a command, the exec's next poll could find
        # it gone and have it re-created before the stop)
        os.unlink(Path(ws.record.root, ".bunshin/run/agent.sock"))
        with pytest.raises(AgentError) as info:
            ws.exec("echo never")
        err = info.value
        assert "did not re-create its socket" in err.message and "remove the workspace" in (err.hint or "")
    finally:
        os.kill(ws.record.pid, 18)  # SIGCONT
    assert ws.exec("echo alive").stdout == "alive\n"


def test_sighup_from_inside_only_makes_the_agent_check_its_socket(ws):
    """pid 1 handles SIGHUP (the host's request to re-create its socket); sent from inside,
    in a parent or a clone (whose socket CRIU bound anew), it changes nothing."""
    (clone,) = ws.fork(1)
    try:
        for w in (ws, clone):
            inode = w.exec("stat -c %i /.bunshin/run/agent.sock").stdout
            for _ in range(3):
                w.exec("kill -HUP 1")
                assert w.exec("echo alive").stdout == "alive\n"
            assert w.exec("stat -c %i /.bunshin/run/agent.sock").stdout == inode
            assert "re-created" not in w.exec("cat /.bunshin/run/agent.log").stdout
            assert w.agent().ping().pid == 1
    finally:
        clone.remove()
