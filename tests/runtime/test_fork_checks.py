"""fork_checks against real processes of the host: nested namespaces (which a
workspace cannot make today), and what is left alone (connected TCP sockets too)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bunshin.errors import NotForkable
from bunshin.runtime.snapshot import fork_checks


def _needs_root() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare")


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*argv: str) -> int:
        p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, close_fds=True)
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _settled(pid: int, command: str, timeout: float = 10, *, arg: str | None = None) -> int:
    """``pid`` once its command name starts with ``command`` (after unshare's exec), or its child's
    does; with ``arg``, once its command line holds it too (a fork of this Python, not yet
    exec'd, is called "python" as well)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for cand in [pid, *map(int, open(f"/proc/{pid}/task/{pid}/children").read().split())]:
            with open(f"/proc/{cand}/comm") as f:
                named = f.read().strip().startswith(command)
            if named and (arg is None or arg.encode() in open(f"/proc/{cand}/cmdline", "rb").read().split(b"\0")):
                return cand
        time.sleep(0.01)
    raise TimeoutError(f"{pid} does not run {command}")


@pytest.mark.parametrize(("flags", "what"), [
    (["--ipc"], "is in its own ipc namespace"),
    (["--uts"], "is in its own uts namespace"),
    (["--cgroup"], "is in its own cgroup namespace"),
    (["--pid"], "made for its children its own pid namespace"),
    (["--pid", "--fork"], "is in its own pid namespace"),
    (["--time"], "is in its own time namespace"),  # exec entered the one made for children
])
def test_a_nested_namespace_is_refused_naming_it(spawn, flags, what):
    _needs_root()
    pid = _settled(spawn("unshare", *flags, "sleep", "60"), "sleep")
    found = fork_checks.refusals([os.getpid(), pid])
    assert [(r.task.host_pid, r.what) for r in found] == [(pid, what)]
    assert found[0].task.command == "sleep 60" and "CRIU cannot dump a nested" in found[0].why
    with pytest.raises(NotForkable) as info:
        fork_checks.check("ws-x", [os.getpid(), pid])
    assert info.value.message.startswith(f"workspace ws-x cannot be forked: process {pid} (sleep 60) {what}")
    assert "no-sandbox" in (info.value.hint or "")


def test_processes_of_the_same_namespaces_and_listening_sockets_pass(spawn):
    _needs_root()
    pid = _settled(spawn("sleep", "60"), "sleep")
    with socket.socket() as lsk:
        lsk.bind(("127.0.0.1", 0))
        lsk.listen(1)
        assert fork_checks.refusals([os.getpid(), pid]) == []
        fork_checks.check("ws-x", [os.getpid(), pid])  # raises nothing


def test_a_connected_socket_is_not_refused():
    with socket.socket(socket.AF_INET6) as lsk:
        lsk.bind(("::1", 0))
        lsk.listen(1)
        with socket.create_connection(lsk.getsockname()[:2]):
            server, _ = lsk.accept()
            with server:
                assert fork_checks.refusals([os.getpid()]) == []  # CRIU carries it (netns_image)


def test_a_command_is_named_without_its_control_characters(spawn):
    _needs_root()
    code = "import time; time.sleep(60)"
    pid = _settled(spawn("unshare", "--ipc", sys.executable, "-c", code, "\x1b[2J\nforged line"), "python", arg=code)
    found = fork_checks.refusals([os.getpid(), pid])
    assert len(found) == 1, (found, open(f"/proc/{pid}/stat").read(), os.readlink(f"/proc/{pid}/ns/ipc"),
                             os.readlink(f"/proc/{os.getpid()}/ns/ipc"))
    assert found[0].task.command.endswith(f" -c {code} ?[2J?forged line")


def test_an_empty_tree_passes():
    assert fork_checks.refusals([]) == []


def test_a_zombie_waiting_to_be_reaped_passes():
    """An exited child its parent has not waited for yet: its namespaces read ENOENT but pid's."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert fork_checks.refusals([os.getpid(), child]) == []
    finally:
        os.waitpid(child, 0)


def _fake_process(proc, pid: int, links: dict[str, str]) -> None:
    """A /proc entry of ``pid`` in the workspace's pid namespace (level 0) with these ns links."""
    base = proc / str(pid)
    (base / "ns").mkdir(parents=True)
    (base / "task" / str(pid)).mkdir(parents=True)
    (base / "status").write_text(f"Name:\tsleep\nNSpid:\t{pid}\nTracerPid:\t0\n")
    (base / "stat").write_text(f"{pid} (sleep) S 1 1 1\n")
    (base / "cmdline").write_bytes(b"sleep\x000.05\x00")
    (base / "fd").mkdir()
    (base / "maps").write_text("")
    for ns, target in links.items():
        (base / "ns" / ns).symlink_to(target)


_OWN = {"ipc": "ipc:[1]", "uts": "uts:[2]", "pid": "pid:[3]", "cgroup": "cgroup:[4]", "time": "time:[5]",
        "user": "user:[6]", "pid_for_children": "pid:[3]", "time_for_children": "time:[5]"}


def test_a_process_exiting_past_its_namespaces_is_not_taken_for_a_nested_one(tmp_path):
    """Between dropping its namespace set and becoming a zombie, an exiting process reads
    ENOENT for uts, pid_for_children and the rest, but its pid namespace still reads: not
    a pid namespace made for its children (a CI run refused a fork of a busybox loop's
    exiting `sleep` so)."""
    _fake_process(tmp_path, 1, _OWN)
    _fake_process(tmp_path, 14, {"pid": "pid:[3]", "user": "user:[6]"})
    assert fork_checks.refusals([1, 14], proc=tmp_path) == []


def test_an_unborn_pid_namespace_of_a_live_process_is_still_refused(tmp_path):
    """The same ENOENT from a process that still holds its namespaces (uts reads) is a pid
    namespace made for its children that no child entered yet."""
    _fake_process(tmp_path, 1, _OWN)
    _fake_process(tmp_path, 14, {k: v for k, v in _OWN.items() if k != "pid_for_children"})
    found = fork_checks.refusals([1, 14], proc=tmp_path)
    assert [(r.task.pid, r.what) for r in found] == [(14, "made for its children its own pid namespace")]
