"""The agent's lean start of a child (``spawn``), its pool and event (``pool``), the
session marker search (``shellpty._find_end``): real processes, threads and pipes."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from bunshin.agent import spawn
from bunshin.agent.pool import Flag, Pool
from bunshin.agent.shellpty import _find_end


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _read_all(stream: spawn.Stream) -> bytes:
    out = b""
    while chunk := os.read(stream.fileno(), 65536):
        out += chunk
    stream.close()
    return out


def test_start_pipes_env_cwd_and_session(tmp_path):
    pid, stdin, stdout, stderr = spawn.start(
        ["sh", "-c", 'read x; echo "$x $FOO $(pwd) $(ps -o sid= -p $$)"; echo err >&2'],
        env={"FOO": "bar", "PATH": os.environ["PATH"]}, cwd=str(tmp_path),
        stdin=spawn.PIPE, stdout=spawn.PIPE, stderr=spawn.PIPE, preexec_fn=None)
    assert stdin is not None and stdout is not None and stderr is not None
    os.write(stdin.fileno(), b"hello\n")
    stdin.close()
    assert stdin.closed
    words = _read_all(stdout).decode().split()
    assert words[:3] == ["hello", "bar", str(tmp_path)]
    assert int(words[3]) == pid  # a new session, led by the child
    assert _read_all(stderr) == b"err\n"
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_start_errors_as_popen_raises_them_and_leaks_no_descriptor(tmp_path):
    before = _fds()
    with pytest.raises(FileNotFoundError) as exc:
        spawn.start(["no-such-program-x"], env={"PATH": str(tmp_path)}, cwd=str(tmp_path),
                    stdin=spawn.DEVNULL, stdout=spawn.PIPE, stderr=spawn.PIPE, preexec_fn=None)
    assert exc.value.filename == "no-such-program-x"
    with pytest.raises(FileNotFoundError) as exc:
        spawn.start(["/bin/true"], env={}, cwd=str(tmp_path / "gone"),
                    stdin=spawn.DEVNULL, stdout=spawn.PIPE, stderr=spawn.PIPE, preexec_fn=None)
    assert exc.value.filename == str(tmp_path / "gone")
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    with pytest.raises(PermissionError):
        spawn.start([str(script)], env={}, cwd=str(tmp_path),
                    stdin=None, stdout=spawn.PIPE, stderr=None, preexec_fn=None)

    def refuse() -> None:
        raise OSError("refused")

    with pytest.raises(subprocess.SubprocessError):
        spawn.start(["/bin/true"], env={}, cwd=str(tmp_path), stdin=None, stdout=None, stderr=None,
                    preexec_fn=refuse)
    with pytest.raises(ValueError, match="environment variable name"):
        spawn.start(["/bin/true"], env={"A=B": "1"}, cwd=str(tmp_path), stdin=None, stdout=None,
                    stderr=None, preexec_fn=None)
    assert _fds() == before


def test_start_closes_other_descriptors(tmp_path):
    r, w = os.pipe()
    os.set_inheritable(w, True)  # inheritable, yet not passed: the child must not hold it
    try:
        pid, _, stdout, _ = spawn.start(["sh", "-c", f"ls /proc/self/fd; test -e /proc/self/fd/{w}"],
                                        env={"PATH": os.environ["PATH"]}, cwd=str(tmp_path),
                                        stdin=spawn.DEVNULL, stdout=spawn.PIPE, stderr=spawn.DEVNULL,
                                        preexec_fn=None)
        assert stdout is not None
        _read_all(stdout)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1
    finally:
        os.close(r)
        os.close(w)


def test_flag_wait_set_and_timeout():
    flag = Flag()
    t0 = time.monotonic()
    assert not flag.wait(0.05) and time.monotonic() - t0 >= 0.05
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(flag.wait(5))) for _ in range(3)]
    for t in waiters:
        t.start()
    flag.set()
    flag.set()  # twice: no error
    for t in waiters:
        t.join(5)
    assert woke == [True, True, True] and flag.is_set() and flag.wait(0)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return predicate()


def test_pool_runs_calls_beyond_its_threads_and_survives_a_failing_one(capsys):
    pool = Pool(keep=2)
    gate, done = threading.Event(), []

    def work(i: int) -> None:
        gate.wait(5)
        done.append(i)

    def fail() -> None:
        raise RuntimeError("boom")

    pool.submit(fail)
    for i in range(4):  # more than it keeps, all blocked at once: it starts more
        pool.submit(work, i)
    gate.set()
    assert _until(lambda: len(done) == 4) and sorted(done) == [0, 1, 2, 3]
    assert "boom" in capsys.readouterr().err
    assert _until(lambda: pool.threads == 2)  # those past ``keep`` ended once idle
    pool.trim()


def test_trim_ends_the_idle_threads_now_and_a_busy_one_with_its_call():
    pool = Pool()
    before = _os_threads()
    ran: list[int] = []
    for i in range(3):
        pool.submit(ran.append, i)
    assert _until(lambda: len(ran) == 3)
    assert _until(lambda: pool.threads >= 1)
    started = pool.threads
    gate, busy_done = threading.Event(), threading.Event()

    def busy() -> None:
        gate.wait(5)
        busy_done.set()

    pool.submit(busy)  # takes an idle thread (or a new one)
    assert _until(lambda: pool.threads >= 1)
    left = pool.trim()
    assert left == 1  # the busy one
    assert _until(lambda: pool.threads == 1) and _until(lambda: _os_threads() == before + 1)
    gate.set()
    assert busy_done.wait(5)
    assert _until(lambda: pool.threads == 0) and _until(lambda: _os_threads() == before)  # it ended with its call
    assert started >= 1
    pool.submit(ran.append, 9)  # a call after the trim starts a thread, which waits again
    assert _until(lambda: ran[-1:] == [9])
    assert _until(lambda: pool.threads == 1) and not _until(lambda: pool.threads == 0, 0.1)
    assert pool.trim() == 0 and _until(lambda: pool.threads == 0) and _until(lambda: _os_threads() == before)


@pytest.mark.parametrize(("window", "end", "digits", "found"), [
    (b"out\x1eBStE0\x1e", b"\x1eBStE", True, (3, 0)),
    (b"out\x1eBStE127\x1erest", b"\x1eBStE", True, (3, 127)),
    (b"out\x1eBStE12", b"\x1eBStE", True, (-1, None)),  # not all there yet
    (b"\x1eBStEx\x1e \x1eBStE3\x1e", b"\x1eBStE", True, (8, 3)),  # a lookalike first
    (b"\x1eBStE\x1e", b"\x1eBStE", True, (-1, None)),  # an exit code needs digits
    (b"..\x1eBStY\x1e", b"\x1eBStY", False, (2, None)),
    (b"..\x1eBStY1\x1e", b"\x1eBStY", False, (-1, None)),  # a sync marker has none
])
def test_find_end(window, end, digits, found):
    assert _find_end(bytearray(window), end, digits) == found
