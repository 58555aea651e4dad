"""The in-workspace agent, run on the host as a subprocess, driven through ``AgentClient``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bunshin.agent.shellpty import CONTINUED_NOTE, MAX_SESSIONS
from bunshin.errors import (
    AgentError,
    InvalidArgument,
    NotFound,
    PathNotFound,
    ResourceExhausted,
    StateConflict,
)
from bunshin.runtime.agent_host.client import AgentClient
from bunshin.runtime.agent_host.types import FileType

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.agent.conftest import RunningAgent

    AgentFactory = Callable[..., RunningAgent]

LEAK_MARKER = "BUNSHIN_TEST_AGENT_ONLY"  # set in the agent's environment by conftest


def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def zombie_children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == pid:
                out.append(int(name))
    return out


def raw_exchange(path: Path, *lines: bytes) -> list[dict]:
    """Send raw request lines on ONE connection and read one answer per line."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        reader = sock.makefile("rb")
        answers = []
        for line in lines:
            sock.sendall(line + b"\n")
            answers.append(json.loads(reader.readline()))
        return answers


# --- ping, identity, protocol ---------------------------------------------------------


def test_ping(agent: RunningAgent) -> None:
    info = agent.client.ping()
    assert info.pid == agent.proc.pid
    assert info.version == "1"
    assert info.uptime_s > 0


def test_identify_publishes_identity(fresh_agent: RunningAgent) -> None:
    client, run_dir = fresh_agent.client, fresh_agent.run_dir
    assert client.ping().identity == {}
    client.identify({"fork_id": "f-1", "parent": "ws-9", "n": 2})
    assert client.ping().identity == {"fork_id": "f-1", "parent": "ws-9", "n": 2}
    assert json.loads((run_dir / "identity.json").read_text())["parent"] == "ws-9"
    assert (run_dir / "fork-id").read_text().strip() == "f-1"
    client.identify({"workspace": "w"})
    assert not (run_dir / "fork-id").exists()
    with pytest.raises(InvalidArgument):
        client.call("identify", identity=[1, 2])


def test_malformed_requests_get_errors_on_the_same_connection(agent: RunningAgent) -> None:
    answers = raw_exchange(
        agent.socket,
        b"this is not json",
        b"[1, 2]",
        b'{"op": 5}',
        b'{"op": "no_such_op"}',
        b'{"op": "exec", "argv": "ls"}',
        b'{"op": "exec", "argv": []}',
        b'{"op": "exec", "argv": ["true"], "cmd": "true"}',
        b'{"op": "exec", "argv": ["true"], "timeout": "soon"}',
        b'{"op": "exec", "argv": ["true"], "timeout": -1}',
        b'{"op": "exec", "argv": ["true"], "env": {"A": 1}}',
        b'{"op": "read_file", "path": 5}',
        b'{"op": "read_file", "path": "relative/path"}',
        b'{"op": "read_file", "path": "/etc/hostname", "offset": -3}',
        b'{"op": "write_file", "path": "/tmp/x", "data_b64": "!!not base64"}',
        b'{"op": "session_run", "session_id": 3, "command": "true"}',
        b'{"op": "kill", "pid": true}',
        b"\xff\xfe\x00",
        b'{"op": "ping"}',
    )
    *errors, pong = answers
    for answer in errors:
        assert answer["ok"] is False, answer
        assert answer["error"]["code"] == "invalid_argument", answer
        assert answer["error"]["message"]
    assert pong["ok"] is True and pong["pid"] == agent.proc.pid


def test_blank_lines_and_several_requests_per_connection(agent: RunningAgent) -> None:
    # blank lines get no answer: the first answer belongs to ping
    answers = raw_exchange(agent.socket, b'\n  \n{"op":"ping"}', b'{"op":"session_list"}')
    assert answers[0]["ok"] and "pid" in answers[0]
    assert answers[1]["ok"] and "sessions" in answers[1]


def test_truncated_request_does_not_hurt_the_agent(agent: RunningAgent) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(agent.socket))
        sock.sendall(b'{"op": "pi')
        sock.shutdown(socket.SHUT_WR)
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["error"]["code"] == "invalid_argument"
    assert agent.client.ping().pid == agent.proc.pid


def test_client_side_argument_errors(client: AgentClient) -> None:
    with pytest.raises(InvalidArgument):
        client.exec()
    with pytest.raises(InvalidArgument):
        client.exec(["true"], cmd="true")
    with pytest.raises(InvalidArgument):
        client.exec("ls -l")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        client.identify({"x": object()})


# --- client failure paths -----------------------------------------------------------


def test_unreachable_agent(tmp_path: Path) -> None:
    client = AgentClient(tmp_path / "nobody.sock")
    with pytest.raises(AgentError, match="not reachable"):
        client.ping()
    started = time.monotonic()
    with pytest.raises(AgentError, match="not ready"):
        client.wait_ready(0.3)
    assert time.monotonic() - started < 2
    # a socket file nobody listens on
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()
    with pytest.raises(AgentError):
        AgentClient(tmp_path / "dead.sock").ping()


def _fake_agent(path: Path, answer: bytes | None) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                if answer is not None:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "answer, match",
    [
        (b"garbage\n", "malformed"),
        (b"[1]\n", "unexpected"),
        (b'{"ok": false}\n', "without saying why"),
        (b'{"ok": true}\n', "lacks 'pid'"),
        (None, "closed the connection"),
        (b'{"ok": tr', "closed the connection"),
    ],
)
def test_broken_agent_answers_are_agent_errors(
    tmp_path: Path, answer: bytes | None, match: str
) -> None:
    thread = _fake_agent(tmp_path / "fake.sock", answer)
    with pytest.raises(AgentError, match=match):
        AgentClient(tmp_path / "fake.sock").ping()
    thread.join(5)


def test_silent_agent_times_out(tmp_path: Path) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "silent.sock"))
    server.listen(1)
    try:
        client = AgentClient(tmp_path / "silent.sock", call_timeout=0.2)
        with pytest.raises(AgentError, match="in time"):
            client.ping()
        started = time.monotonic()
        with pytest.raises(AgentError, match="not ready"):
            AgentClient(tmp_path / "silent.sock").wait_ready(0.3)  # not one 60 s call
        assert time.monotonic() - started < 2
    finally:
        server.close()


def test_error_codes_become_bunshin_errors(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(PathNotFound) as info:
        client.read_file(tmp_path / "missing")
    assert isinstance(info.value, FileNotFoundError)
    assert "missing" in str(info.value)
    with pytest.raises(NotFound):
        client.session_run("no-such-session", "true")


def test_long_socket_path(tmp_path: Path, agent_factory: AgentFactory) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sock = deep / "agent.sock"
    assert len(os.fsencode(sock)) > 108
    running = agent_factory(sock, tmp_path / "run")
    assert running.client.ping().pid == running.proc.pid
    assert running.client.exec(["echo", "far"]).stdout == "far\n"
    assert sock.exists()
    running.stop()
    assert not sock.exists()


# --- exec ---------------------------------------------------------------------------


def test_exec_output_and_status(client: AgentClient, tmp_path: Path) -> None:
    r = client.exec(cmd="echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == (
        "out\n",
        "err\n",
        3,
        None,
        False,
    )
    assert not r.ok and r.duration_s > 0
    r = client.exec(["printf", "%s|", "a b", "c"], cwd=tmp_path)
    assert r.stdout == "a b|c|" and r.ok
    assert client.exec(["pwd"], cwd=tmp_path).stdout == f"{tmp_path}\n"


def test_exec_environment_is_clean(client: AgentClient) -> None:
    r = client.exec(["env"])
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert LEAK_MARKER not in env and "PYTHONPATH" not in env
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert (env["HOME"], env["LANG"], env["TERM"]) == ("/root", "C.UTF-8", "xterm-256color")
    r = client.exec(cmd="echo $X-$HOME", env={"X": "42", "HOME": "/tmp"})
    assert r.stdout == "42-/tmp\n"


def test_exec_stdin_and_unicode(client: AgentClient) -> None:
    data = "héllo\n" * 50_000  # larger than a pipe buffer
    r = client.exec(["wc", "-c"], stdin=data)
    assert r.stdout.strip() == str(len(data.encode()))
    assert client.exec(["cat"], stdin="ünï\n").stdout == "ünï\n"
    r = client.exec(cmd="printf 'bad \\377 byte'")
    assert r.stdout == "bad \ufffd byte"
    # a child that never reads its stdin does not block the agent
    r = client.exec(["true"], stdin="x" * 1_000_000)
    assert r.exit_code == 0


def test_exec_truncates_but_keeps_draining(client: AgentClient) -> None:
    r = client.exec(cmd="head -c 3000000 /dev/zero | tr '\\0' a; echo done >&2", max_output=1000)
    assert r.exit_code == 0 and r.stdout_truncated and not r.stderr_truncated
    assert r.stdout.startswith("a" * 1000)
    assert r.stdout.endswith("[bunshin: output truncated, 2999000 bytes dropped]")
    assert r.stderr == "done\n"


def test_exec_timeout_kills_the_process_group(client: AgentClient, tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    started = time.monotonic()
    r = client.exec(cmd=f"sleep 30 & echo $! > {pidfile}; echo partial; sleep 30", timeout=0.5)
    assert time.monotonic() - started < 5
    assert r.timed_out and r.exit_code == -9 and r.signal == 9
    assert r.stdout == "partial\n"
    background = int(pidfile.read_text())
    wait_until(lambda: not pid_alive(background), what="the background sleep to die")


def test_exec_returns_when_a_daemon_keeps_the_pipes(client: AgentClient, tmp_path: Path) -> None:
    pidfile = tmp_path / "daemon.pid"
    started = time.monotonic()
    r = client.exec(cmd=f"sleep 30 & echo $! > {pidfile}; echo bye")
    assert time.monotonic() - started < 2
    assert (r.stdout, r.exit_code, r.timed_out) == ("bye\n", 0, False)
    background = int(pidfile.read_text())
    assert pid_alive(background)  # not ours to kill: it was not a timeout
    os.kill(background, 9)


def test_exec_killed_by_signal(client: AgentClient) -> None:
    r = client.exec(cmd="kill -TERM $$")
    assert (r.exit_code, r.signal, r.timed_out) == (-15, 15, False)


def test_exec_errors(client: AgentClient, tmp_path: Path) -> None:
    with pytest.raises(PathNotFound, match="no-such-program"):
        client.exec(["no-such-program-xyz"])
    with pytest.raises(PathNotFound):
        client.exec(["/no/such/binary"])
    with pytest.raises(PathNotFound, match="cwd"):
        client.exec(["true"], cwd=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        client.exec(["true"], cwd=tmp_path / "file")
    with pytest.raises(InvalidArgument, match="permission denied"):
        client.exec([str(tmp_path / "file")])  # not executable
    (tmp_path / "garbage").write_bytes(b"\x7fELF garbage")
    (tmp_path / "garbage").chmod(0o755)
    with pytest.raises(InvalidArgument):
        client.exec([str(tmp_path / "garbage")])
    with pytest.raises(InvalidArgument):
        client.exec(["true"], cwd="relative")


def test_exec_drops_capabilities(client: AgentClient) -> None:
    with open("/proc/self/status") as f:
        own = int(next(ln for ln in f if ln.startswith("CapBnd:")).split()[1], 16)
    if not own & (1 << 21):
        pytest.skip("this process has no CAP_SYS_ADMIN to drop")
    out = client.exec(["grep", "-E", "^Cap(Bnd|Eff):", "/proc/self/status"]).stdout
    caps = {ln.split(":")[0]: int(ln.split()[1], 16) for ln in out.splitlines()}
    for bit in (2, 16, 17, 19, 21, 22, 25, 27, 30, 32, 33, 34, 37, 38, 39):
        assert not caps["CapBnd"] & (1 << bit), f"capability {bit} still in the bounding set"
        assert not caps["CapEff"] & (1 << bit)
    assert caps["CapBnd"] & (1 << 0)  # CAP_CHOWN untouched


def test_exec_is_fast(client: AgentClient, calls: str) -> None:
    if calls == "fork":
        pytest.skip("--calls fork trades latency for a clone's memory: `bunshin bench clone-memory` "
                    "and the README measure both")
    times = []
    for _ in range(30):
        started = time.perf_counter()
        assert client.exec(["true"]).exit_code == 0
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    print(f"exec true round trip: median {median * 1000:.2f} ms")
    assert median < 0.05


def test_concurrent_execs_get_their_own_status(agent: RunningAgent) -> None:
    def one(n: int) -> tuple[int, int, str]:
        r = agent.client.exec(cmd=f"echo {n}; exit {n % 200}")
        return n, r.exit_code, r.stdout

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(300)))
    for n, code, out in results:
        assert (code, out) == (n % 200, f"{n}\n")
    wait_until(lambda: not zombie_children(agent.proc.pid), what="the agent to reap everything")


# --- spawn, kill, processes -----------------------------------------------------------


def test_spawn_runs_in_background_and_is_reaped(agent: RunningAgent, tmp_path: Path) -> None:
    client = agent.client
    log = tmp_path / "spawn.log"
    pid = client.spawn(cmd="echo started $FOO; exec sleep 30", env={"FOO": "bar"}, log_path=log)
    wait_until(lambda: log.read_text() == "started bar\n", what="the log line")
    procs = {p.pid: p for p in client.processes()}
    assert procs[pid].cmdline == ("sleep", "30")
    assert procs[pid].ppid == agent.proc.pid and procs[pid].sid == pid
    client.kill(pid, 15)
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), what="the spawned process to be reaped")
    with pytest.raises(NotFound):
        client.kill(pid)
    with pytest.raises(PathNotFound):
        client.spawn(["no-such-program-xyz"])
    with pytest.raises(PathNotFound):
        client.spawn(["true"], log_path=tmp_path / "no" / "dir" / "log")


def test_kill_process_group(client: AgentClient, tmp_path: Path) -> None:
    pid = client.spawn(cmd=f"sleep 30 & echo $! > {tmp_path}/child; sleep 30")
    wait_until(
        lambda: (tmp_path / "child").exists() and (tmp_path / "child").read_text().strip() != ""
    )
    child = int((tmp_path / "child").read_text())
    client.kill(pid, 9, group=True)
    wait_until(lambda: not pid_alive(child) and not pid_alive(pid), what="the group to die")


def test_processes_lists_the_agent(agent: RunningAgent) -> None:
    procs = {p.pid: p for p in agent.client.processes()}
    me = procs[agent.proc.pid]
    assert "bunshin.agent" in me.cmdline
    assert me.state in ("S", "R")
    assert procs[os.getpid()].pid == os.getpid()


# --- files --------------------------------------------------------------------------


def test_write_read_roundtrip(client: AgentClient, tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "f.bin"
    data = bytes(range(256)) * 10
    with pytest.raises(PathNotFound, match="mkdirs"):
        client.write_file(path, data)
    assert client.write_file(path, data, mkdirs=True) == len(data)
    assert path.read_bytes() == data
    assert client.read_file(path) == data
    assert client.read_file(path, offset=10, length=5) == data[10:15]
    assert client.read_file(path, offset=len(data) + 5) == b""
    assert client.write_file(path, "tail", append=True) == len(data) + 4
    assert client.read_file(path)[-4:] == b"tail"
    assert client.write_file(path, "") == 0
    client.write_file(tmp_path / "x.sh", "#!/bin/sh\necho hi\n", mode=0o750)
    assert (tmp_path / "x.sh").stat().st_mode & 0o777 == 0o750
    assert client.exec([str(tmp_path / "x.sh")]).stdout == "hi\n"


def test_large_file_goes_in_chunks(client: AgentClient, tmp_path: Path) -> None:
    data = os.urandom(20 * 1024 * 1024 + 123)
    assert client.write_file(tmp_path / "big", data) == len(data)
    assert (tmp_path / "big").read_bytes() == data
    assert client.read_file(tmp_path / "big") == data
    assert (
        client.read_file(tmp_path / "big", offset=17 * 1024 * 1024, length=10)
        == data[17 * 1024 * 1024 : 17 * 1024 * 1024 + 10]
    )


def test_proc_files_of_processes_inside_are_readable(client: AgentClient, tmp_path: Path) -> None:
    pid = client.spawn(["sleep", "30"], env={"CANARY": "inside"})
    try:
        assert b"Name:\tsleep" in client.read_file(f"/proc/{pid}/status")
        assert b"CANARY=inside" in client.read_file(f"/proc/{pid}/environ")
        assert client.stat(f"/proc/{pid}/fd").type == FileType.DIR
        assert {e.name for e in client.list_dir(f"/proc/{pid}/fd")} >= {"0", "1", "2"}
        (tmp_path / "own").symlink_to(f"/proc/{pid}")
        assert b"CANARY=inside" in client.read_file(tmp_path / "own" / "environ")
    finally:
        client.kill(pid, 9)


def _agent_paths(agent: RunningAgent, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Paths through the agent's own /proc entries, however reached; and symlinks to them
    (a stat or a remove of those is of the link itself)."""
    pid = agent.agent_pid
    tids = os.listdir(f"/proc/{pid}/task")
    (tmp_path / "abs").symlink_to("/proc/self/environ")
    (tmp_path / "procdir").symlink_to("/proc")
    (tmp_path / "chain").symlink_to(tmp_path / "procdir")
    (tmp_path / "rel").symlink_to("../" * len(tmp_path.parts) + "proc/thread-self")
    (tmp_path / "log").symlink_to("/proc/self/fd/2")
    return [
        "/proc/self/environ", "/proc/self/maps", "/proc/self/mem", "/proc/self/status", "/proc/self/fd/2",
        "/proc/thread-self/environ", f"/proc/{pid}/environ", f"/proc/{pid}/root/etc/hostname",
        f"/proc/{pid}/cwd", f"/proc/{pid}/fd", *(f"/proc/{pid}/task/{t}/environ" for t in tids),
        *(f"/proc/{t}/environ" for t in tids), "/proc//self/./environ", "/proc/self/../self/environ",
        f"/proc/sys/../{pid}/environ", str(tmp_path / "procdir/self/environ"),
        str(tmp_path / "chain/self/environ"), str(tmp_path / "rel/environ"),
    ], [str(tmp_path / "abs"), str(tmp_path / "log")]


def test_the_agents_own_proc_entries_are_refused(agent: RunningAgent, tmp_path: Path) -> None:
    """The agent may open its own /proc entries (its thread group always may); a file call
    must not: processes inside are refused them (EACCES), however the path gets there."""
    client = agent.client
    through, links = _agent_paths(agent, tmp_path)
    following = (client.read_file, client.list_dir, lambda p: client.write_file(p, "x"))
    for path, calls in [*((p, (*following, client.stat, client.remove)) for p in through),
                        *((p, following) for p in links)]:
        for call in calls:
            with pytest.raises(InvalidArgument, match="permission denied.*the workspace agent's own") as info:
                call(path)
            assert "exec" in (info.value.hint or ""), path
    # where a command runs and where a spawned one logs (the child enters its folder before it
    # drops the agent's capability; the log is opened by the agent)
    with pytest.raises(InvalidArgument, match="permission denied"):
        client.exec(["true"], cwd=f"/proc/{agent.agent_pid}/cwd")
    with pytest.raises(InvalidArgument, match="permission denied"):
        client.session_open(cwd="/proc/self/cwd")
    with pytest.raises(InvalidArgument, match="permission denied"):
        client.spawn(["echo", "canary"], log_path=str(tmp_path / "log"))
    assert client.stat(tmp_path / "log").link_target == "/proc/self/fd/2"  # the link itself
    client.remove(tmp_path / "log")
    assert not (tmp_path / "log").is_symlink()
    # another process's links that lead there: a descriptor of the agent's /proc folder, a cwd in it
    hold = tmp_path / "hold"
    pid = client.spawn(["python3", "-c", f"import os, time; fd = os.open('/proc/{agent.agent_pid}', os.O_RDONLY); "
                        f"open('{hold}', 'w').write(str(fd)); time.sleep(60)"])
    cwd = client.spawn(cmd=f"cd /proc/{agent.agent_pid} && exec sleep 60")
    try:
        wait_until(lambda: hold.exists() and hold.read_text() != "", timeout=30, what="the holder's descriptor")
        for path in (f"/proc/{pid}/fd/{hold.read_text()}/environ", f"/proc/{cwd}/cwd/environ"):
            with pytest.raises(InvalidArgument, match="permission denied"):
                client.read_file(path)
    finally:
        client.kill(pid, 9)
        client.kill(cwd, 9)
    assert client.read_file(tmp_path / "hold") == hold.read_bytes()  # ordinary files as before


def test_files_through_symlinks_and_dotdot_as_the_kernel_resolves_them(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_text("deep")
    (tmp_path / "up").symlink_to("d/e")
    (tmp_path / "abs").symlink_to(tmp_path / "d")
    (tmp_path / "dangling").symlink_to("d/new")
    (tmp_path / "loop").symlink_to("loop")
    assert client.read_file(tmp_path / "up" / "f") == b"deep"
    assert client.read_file(f"{tmp_path}/up/../e/f") == b"deep"  # .. of where the link led, as the kernel
    assert client.read_file(f"{tmp_path}/abs/./e/../e/f") == b"deep"
    client.write_file(tmp_path / "dangling", "made")  # created where the link points, as open(O_CREAT)
    assert (tmp_path / "d" / "new").read_text() == "made"
    assert [e.name for e in client.list_dir(tmp_path / "abs")] == ["e", "new"]
    assert client.stat(tmp_path / "up").type == FileType.SYMLINK
    with pytest.raises(AgentError, match="symbolic links"):
        client.read_file(tmp_path / "loop")
    client.remove(tmp_path / "up")
    assert (tmp_path / "d" / "e" / "f").exists()


def test_file_errors(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(PathNotFound):
        client.read_file(tmp_path / "missing")
    with pytest.raises(InvalidArgument, match="is a directory"):
        client.read_file(tmp_path / "dir")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        client.read_file(tmp_path / "fifo")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        client.write_file(tmp_path / "fifo", "x")
    with pytest.raises(InvalidArgument, match="is a directory"):
        client.write_file(tmp_path / "dir", "x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        client.list_dir(tmp_path / "file")
    with pytest.raises(InvalidArgument):
        client.write_file(tmp_path / "file" / "below", "x")
    with pytest.raises(PathNotFound):
        client.list_dir(tmp_path / "missing")
    with pytest.raises(PathNotFound):
        client.stat(tmp_path / "missing")
    with pytest.raises(PathNotFound):
        client.remove(tmp_path / "missing")
    with pytest.raises(InvalidArgument):
        client.read_file("relative.txt")
    with pytest.raises(InvalidArgument):
        client.call("read_file", path=str(tmp_path / "file"), length=64 * 1024 * 1024)


def test_list_dir_and_stat(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("12345")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("file")
    os.mkfifo(tmp_path / "fifo")
    entries = client.list_dir(tmp_path)
    assert [(e.name, e.type) for e in entries] == [
        ("dir", FileType.DIR),
        ("fifo", FileType.OTHER),
        ("file", FileType.FILE),
        ("link", FileType.SYMLINK),
    ]
    file = next(e for e in entries if e.name == "file")
    assert file.size == 5 and file.mtime == pytest.approx((tmp_path / "file").stat().st_mtime)
    assert file.mode == (tmp_path / "file").stat().st_mode & 0o7777
    link = client.stat(tmp_path / "link")
    assert (link.type, link.link_target) == (FileType.SYMLINK, "file")
    assert client.stat(tmp_path).type == FileType.DIR
    assert client.list_dir(tmp_path / "dir") == []


def test_remove(client: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_text("x")
    (tmp_path / "f").write_text("x")
    (tmp_path / "l").symlink_to(tmp_path / "d")
    client.remove(tmp_path / "f")
    client.remove(tmp_path / "l")  # the link, not the directory
    assert not (tmp_path / "l").exists() and (tmp_path / "d").is_dir()
    with pytest.raises(InvalidArgument, match="not empty"):
        client.remove(tmp_path / "d")
    client.remove(tmp_path / "d", recursive=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidArgument):
        client.remove("/", recursive=True)


# --- sessions -----------------------------------------------------------------------


@pytest.fixture
def session(client: AgentClient):
    session_id = client.session_open()
    yield session_id
    client.session_close(session_id)


def test_session_state_persists(client: AgentClient, session: str, tmp_path: Path) -> None:
    run = client.session_run
    r = run(session, f"cd {tmp_path}; X=unexported; export Y=exported; f() {{ echo fn:$1; }}")
    assert (r.output, r.exit_code, r.timed_out, r.alive) == ("", 0, False, True)
    r = run(session, "pwd; echo $X $Y; f 7; bash -c 'echo child:${X:-none}:$Y'")
    assert r.output == f"{tmp_path}\nunexported exported\nfn:7\nchild:none:exported\n"
    history = run(session, "history").output
    assert f"cd {tmp_path}; X=unexported" in history and "f 7" in history
    assert "source" not in history and "printf" not in history  # no wrapper lines


def test_session_exit_status_and_markers(client: AgentClient, session: str) -> None:
    assert client.session_run(session, "false").exit_code == 1
    assert client.session_run(session, "(exit 42)").exit_code == 42
    r = client.session_run(session, "printf 'no newline'")
    assert (r.output, r.exit_code) == ("no newline", 0)
    r = client.session_run(session, "echo out; echo err >&2")
    assert r.output == "out\nerr\n"  # one pty: both streams, in order, no \r
    assert "\x1e" not in r.output


def test_session_multiline_heredoc_and_long_command(client: AgentClient, session: str) -> None:
    command = (
        "V=3\nif [ $V -gt 2 ]; then\n  cat <<EOF\nbig $V\nEOF\nfi\nfor i in 1 2; do echo i$i; done"
    )
    assert client.session_run(session, command).output == "big 3\ni1\ni2\n"
    long = "echo " + "x" * 20_000
    assert client.session_run(session, long).output == "x" * 20_000 + "\n"
    r = client.session_run(session, "if then")
    assert r.exit_code == 2 and "syntax error" in r.output
    assert client.session_run(session, "echo still here").output == "still here\n"


def test_session_echo_is_off(client: AgentClient, session: str) -> None:
    r = client.session_run(session, "echo visible  # a comment that must not be echoed")
    assert r.output == "visible\n"
    r = client.session_run(session, "test -t 0 && test -t 1 && echo tty; stty size")
    assert r.output.splitlines()[0] == "tty"


def test_session_timeout_interrupts_but_keeps_state(client: AgentClient, session: str) -> None:
    client.session_run(session, "KEEP=me")
    started = time.monotonic()
    r = client.session_run(session, "echo before; sleep 30; echo never", timeout=0.5)
    assert time.monotonic() - started < 3
    assert r.timed_out and r.exit_code is None and r.alive
    assert r.output == "before\n"
    r = client.session_run(session, "echo $KEEP; echo next")
    assert (r.output, r.exit_code, r.timed_out) == ("me\nnext\n", 0, False)
    # a busy loop in the shell itself
    r = client.session_run(session, "while :; do :; done", timeout=0.3)
    assert r.timed_out
    assert client.session_run(session, "echo $KEEP").output == "me\n"


def test_session_timeout_escalates_to_sigkill(client: AgentClient, session: str) -> None:
    started = time.monotonic()
    r = client.session_run(session, "sh -c \"trap '' INT; sleep 30\"", timeout=0.3)
    assert r.timed_out
    assert time.monotonic() - started < 6
    assert client.session_run(session, "echo ok").output == "ok\n"


def test_session_command_reading_stdin(client: AgentClient, session: str) -> None:
    r = client.session_run(session, "cat", timeout=0.3)
    assert r.timed_out
    r = client.session_run(session, "read line; echo got:$line", timeout=0.3)
    assert r.timed_out
    assert client.session_run(session, "echo fine").output == "fine\n"


def test_session_shell_stopped_from_inside_is_continued(client: AgentClient, session: str) -> None:
    """``kill -STOP $$`` stops the shell itself: the run still ends (the agent continues the
    shell and says so in the output), and later runs work, also when it is stopped between runs."""
    client.session_run(session, "KEEP=me")
    started = time.monotonic()
    r = client.session_run(session, "echo before; kill -STOP $$; echo after", timeout=30)
    assert time.monotonic() - started < 10
    assert (r.output, r.exit_code, r.timed_out, r.alive) == ("before\nafter\n" + CONTINUED_NOTE, 0, False, True)
    # stopped while a run with a short timeout waits: it times out, then the shell works on
    r = client.session_run(session, "kill -STOP $$; sleep 30", timeout=0.3)
    assert r.timed_out and r.alive and r.output.endswith(CONTINUED_NOTE)
    assert client.session_run(session, "echo $KEEP", timeout=30).output == "me\n"
    # stopped between runs, by a job of its own
    client.session_run(session, "(sleep 0.2; kill -STOP $$) >/dev/null 2>&1 &")
    deadline = time.monotonic() + 10
    while client.exec(["sh", "-c", f"grep -q '^State:.*T (stopped)' /proc/{_shell_pid(client, session)}/status"]).exit_code:
        assert time.monotonic() < deadline, "the job did not stop the shell"
        time.sleep(0.05)
    r = client.session_run(session, "echo $KEEP", timeout=30)
    assert r.output.startswith("me\n") and r.output.endswith(CONTINUED_NOTE) and r.exit_code == 0
    assert client.session_run(session, "echo fine", timeout=30).output.endswith("fine\n")


def test_session_foreground_command_stopped_from_inside_is_continued(client: AgentClient) -> None:
    """A command that stops itself in the foreground: bash (job control) reports it stopped
    and goes on, as a terminal does; a shell without job control would wait for it for
    ever: the agent continues it. Either way the run ends and later runs work."""
    for kind in ("bash", "sh"):
        session = client.session_open(kind)
        try:
            started = time.monotonic()
            r = client.session_run(session, "sh -c 'kill -STOP $$'; echo after", timeout=30)
            assert time.monotonic() - started < 10 and not r.timed_out and r.exit_code == 0, (kind, r)
            assert "after\n" in r.output and ("Stopped" in r.output or r.output.endswith(CONTINUED_NOTE)), (kind, r)
            assert client.session_run(session, "echo next", timeout=30).output == "next\n"
        finally:
            client.session_close(session)


def _shell_pid(client: AgentClient, session_id: str) -> int:
    return next(s.pid for s in client.session_list() if s.session_id == session_id)


def test_sessions_past_the_cap_are_refused_by_name(fresh_agent: RunningAgent) -> None:
    """Sessions opened in a loop stop at ``MAX_SESSIONS`` with a clear error (not at the pids
    limit, where the agent can start no thread and so no exec); the agent keeps serving."""
    client = fresh_agent.client
    opened = [client.session_open() for _ in range(MAX_SESSIONS)]
    for _ in range(3):
        with pytest.raises(ResourceExhausted) as info:
            client.session_open()
        err = info.value
        assert f"{MAX_SESSIONS} sessions are open" in err.message and "close sessions" in (err.hint or "")
    assert client.exec(["echo", "served"]).stdout == "served\n"
    assert len(client.session_list()) == MAX_SESSIONS
    client.session_close(opened.pop())
    opened.append(client.session_open())  # a closed one makes room
    assert client.session_run(opened[-1], "echo ok").output == "ok\n"
    for session_id in opened:
        client.session_close(session_id)
    assert client.session_list() == []


def test_session_truncates_output(client: AgentClient, session: str) -> None:
    r = client.session_run(session, "head -c 500000 /dev/zero | tr '\\0' a; echo", max_output=1000)
    assert r.truncated and r.exit_code == 0
    assert r.output.startswith("a" * 1000)
    assert r.output.endswith("[bunshin: output truncated, 499001 bytes dropped]")
    assert client.session_run(session, "echo small").output == "small\n"


def test_session_open_options_and_clean_env(client: AgentClient, tmp_path: Path) -> None:
    session_id = client.session_open(cwd=tmp_path, env={"FOO": "bar"})
    try:
        r = client.session_run(session_id, f"pwd; echo $FOO; echo ${{{LEAK_MARKER}:-clean}}")
        assert r.output == f"{tmp_path}\nbar\nclean\n"
    finally:
        client.session_close(session_id)
    with pytest.raises(PathNotFound):
        client.session_open(cwd=tmp_path / "missing")
    with pytest.raises(InvalidArgument):
        client.session_open(kind="python")


def test_session_sh_kind(client: AgentClient, tmp_path: Path) -> None:
    if not os.path.exists("/bin/sh"):
        pytest.skip("no /bin/sh")
    session_id = client.session_open(kind="sh")
    try:
        info = {s.session_id: s for s in client.session_list()}[session_id]
        assert info.kind == "sh"
        client.session_run(session_id, f"cd {tmp_path}; A=1")
        assert client.session_run(session_id, "pwd; echo $A").output == f"{tmp_path}\n1\n"
        r = client.session_run(session_id, "if then")
        assert r.exit_code == 2 and r.alive
        assert client.session_run(session_id, "false").exit_code == 1
        assert client.session_run(session_id, "sleep 30", timeout=0.3).timed_out
        assert client.session_run(session_id, "echo $A").output == "1\n"
    finally:
        client.session_close(session_id)


def test_session_busy_and_list(client: AgentClient, session: str) -> None:
    result = {}

    def slow() -> None:
        result["r"] = client.session_run(session, "sleep 0.5; echo slow")

    thread = threading.Thread(target=slow)
    thread.start()
    wait_until(lambda: any(s.busy for s in client.session_list() if s.session_id == session))
    with pytest.raises(StateConflict, match="busy"):
        client.session_run(session, "echo no")
    thread.join(10)
    assert result["r"].output == "slow\n"
    info = {s.session_id: s for s in client.session_list()}[session]
    assert (info.kind, info.busy, info.alive) == ("bash", False, True)
    assert pid_alive(info.pid)


def test_session_shell_exit(client: AgentClient) -> None:
    session_id = client.session_open()
    shell = {s.session_id: s for s in client.session_list()}[session_id].pid
    r = client.session_run(session_id, "echo bye; exit 7")
    assert (r.output, r.exit_code, r.alive) == ("bye\n", 7, False)
    with pytest.raises(StateConflict, match="exited"):
        client.session_run(session_id, "echo again")
    assert not {s.session_id: s for s in client.session_list()}[session_id].alive
    client.session_close(session_id)
    wait_until(lambda: not os.path.exists(f"/proc/{shell}"), what="the shell to be reaped")
    with pytest.raises(NotFound):
        client.session_close(session_id)


def test_session_close_kills_its_jobs(client: AgentClient, tmp_path: Path) -> None:
    session_id = client.session_open()
    client.session_run(session_id, f"sleep 60 & echo $! > {tmp_path}/job")
    job = int((tmp_path / "job").read_text())
    assert pid_alive(job)
    client.session_close(session_id)
    wait_until(lambda: not pid_alive(job), what="the background job to die")
    assert session_id not in {s.session_id for s in client.session_list()}


def test_background_output_between_runs_does_not_leak(client: AgentClient, session: str) -> None:
    client.session_run(session, "(sleep 0.2; echo late-noise) &")
    time.sleep(0.5)
    assert client.session_run(session, "echo clean").output == "clean\n"
    # a chatty background job must never block on a full pty
    client.session_run(session, "(head -c 2000000 /dev/zero | tr '\\0' n; echo) &")
    time.sleep(0.5)
    r = client.session_run(session, "wait; echo waited", timeout=10)
    assert not r.timed_out and r.output.endswith("waited\n")


def test_concurrent_sessions(client: AgentClient) -> None:
    ids = [client.session_open() for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda s: client.session_run(s, "sleep 0.3; echo $$").output, ids))
        pids = {s.session_id: s.pid for s in client.session_list()}
        assert outs == [f"{pids[s]}\n" for s in ids]
    finally:
        for session_id in ids:
            client.session_close(session_id)


# --- attach -------------------------------------------------------------------------


def _read_until(sock: socket.socket, needle: bytes, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while needle not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"EOF before {needle!r}: {data!r}")
        data += chunk
    return data


def test_attach_is_a_raw_pipe_to_a_shell(client: AgentClient) -> None:
    with client.attach(rows=30, cols=100, env={"HISTFILE": "/dev/null"}) as sock:
        sock.sendall(b"echo hi-$((40+2)); stty size\n")
        out = _read_until(sock, b"30 100")
        assert b"hi-42" in out
        sock.sendall(b"exit\n")
        sock.settimeout(10)
        while sock.recv(4096):
            pass  # the agent closes the connection once the shell is gone


def test_attach_client_hangup_ends_the_shell(client: AgentClient, tmp_path: Path) -> None:
    with client.attach(env={"HISTFILE": "/dev/null"}) as sock:
        sock.sendall(f"echo $$ > {tmp_path}/pid; echo written-$((6*7))\n".encode())
        _read_until(sock, b"written-42")  # not the echo of the typed line
        shell = int((tmp_path / "pid").read_text())
    wait_until(lambda: not os.path.exists(f"/proc/{shell}"), what="the attached shell to end")


# --- lifecycle and reaping ------------------------------------------------------------


def test_agent_shutdown_kills_children_and_sessions(fresh_agent: RunningAgent) -> None:
    client = fresh_agent.client
    spawned = client.spawn(["sleep", "60"])
    session_id = client.session_open()
    shell = {s.session_id: s for s in client.session_list()}[session_id].pid
    fresh_agent.stop()  # asserts that nothing is left
    assert not pid_alive(spawned) and not pid_alive(shell)
    assert not fresh_agent.socket.exists()


def test_agent_as_pid1_reaps_orphans(tmp_path: Path, agent_factory: AgentFactory) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    prefix = ("unshare", "--pid", "--fork", "--kill-child", "--mount-proc")
    running = agent_factory(tmp_path / "agent.sock", tmp_path / "run", *prefix)
    assert running.client.ping().pid == 1
    r = running.client.exec(cmd="sleep 0.2 & sleep 0.2 & echo started")
    assert r.stdout == "started\n"  # the two sleeps are now orphans, reparented to the agent
    time.sleep(0.6)
    procs = running.client.processes()
    assert [p for p in procs if p.state == "Z"] == []
    assert {p.pid for p in procs} == {1}
    assert running.client.exec(["true"]).exit_code == 0


# --- units ------------------------------------------------------------------------------


def test_session_markers_split_across_reads() -> None:
    from bunshin.agent.shellpty import Sink as _Sink

    stream = (
        b"junk\x1eBSabcS\x1enot-done \x1eBSzzzE1\x1e" + b"x" * 100 + b"\x1eBSabcE42\x1etrailing"
    )
    sink = _Sink("abc", 1000, output=True)
    for i in range(len(stream)):
        sink.feed(stream[i : i + 1])
    assert sink.matched and sink.exit_code == 42
    assert sink.output.text() == "not-done \x1eBSzzzE1\x1e" + "x" * 100
    small = _Sink("abc", 5, output=True)
    small.feed(stream)
    assert small.output.text() == "not-d\n[bunshin: output truncated, 113 bytes dropped]"
    sync = _Sink("abc", 0, output=False)
    sync.feed(b"noise \x1eBSabcE0\x1e \x1eBSab")
    assert not sync.matched
    sync.feed(b"cY\x1e")
    assert sync.matched and sync.exit_code is None


def test_client_public_api() -> None:
    public = {name for name in vars(AgentClient) if not name.startswith("_")}
    assert public == {
        "call", "ping", "wait_ready", "identify", "exec", "spawn", "kill", "processes",
        "read_file", "iter_file", "write_file", "write_stream", "list_dir", "stat", "remove", "session_open",
        "session_run", "session_close", "session_list", "attach", "trim",
    }  # fmt: skip


def test_trim_ends_the_waiting_threads_and_the_next_calls_start_them_again(fresh_agent, calls: str) -> None:
    client = fresh_agent.client
    client.exec(["true"])  # its connection and job ran on threads of the pool (thread) or in a worker (fork)
    time.sleep(0.2)  # their threads back to waiting (one still busy ending its call would be counted as staying)
    tasks = f"/proc/{fresh_agent.agent_pid}/task"
    before = len(os.listdir(tasks))
    left = client.trim()
    deadline = time.monotonic() + 5
    while len(os.listdir(tasks)) > left and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(os.listdir(tasks)) <= left
    if calls == "thread":
        assert left < before  # the pool's waiting threads (and the one that answered) ended
    else:
        assert left == before  # a forked worker answered: the agent has no pool
    assert client.exec(["echo", "again"]).stdout == "again\n"
    time.sleep(0.2)
    assert client.trim() == left  # the threads that call started end again
