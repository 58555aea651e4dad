"""The criu launcher: commands forked by the warm helper, each in its own fresh network namespace."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest

from bunshin.runtime import criu, prepared

pytestmark = pytest.mark.integration


def _run(argv: list[str], placement: criu.Placement | None = None, timeout: float | None = 10) -> tuple[int, bool, str]:
    with tempfile.TemporaryFile() as out:
        ran = prepared.run(argv, placement, out.fileno(), timeout)
        assert ran is not None, "the launcher did not start"
        out.seek(0)
        return ran[0], ran[1], out.read().decode()


def test_every_run_gets_a_fresh_network_namespace_of_its_own():
    own = os.readlink("/proc/self/ns/net")
    script = "readlink /proc/self/ns/net; cat /proc/sys/net/ipv4/ip_unprivileged_port_start; cat /proc/net/dev"
    seen = []
    for _ in range(4):  # more than the warm pool holds
        code, timed_out, out = _run(["/bin/sh", "-c", script], criu.Placement(new_netns=True))
        assert (code, timed_out) == (0, False), out
        ns, port_start, *dev = out.splitlines()
        assert ns != own and port_start == "0" and any(line.strip().startswith("lo:") for line in dev)
        seen.append(ns)
    assert len(set(seen)) == 4  # never one namespace for two runs
    code, _, out = _run(["/bin/sh", "-c", "readlink /proc/self/ns/net"], criu.Placement(netns="/proc/self/ns/net"))
    assert code == 0 and out.strip() == own  # joined: /proc/self of the helper's child is in the caller's


def test_exit_codes_output_and_a_timeout_that_kills():
    assert _run(["/bin/sh", "-c", "echo out; echo err >&2; exit 3"])[0::2] == (3, "out\nerr\n")
    t0 = time.monotonic()
    code, timed_out, _ = _run(["/bin/sleep", "30"], timeout=0.3)
    assert timed_out and code == -signal.SIGKILL and time.monotonic() - t0 < 10


def test_a_placement_that_fails_and_a_missing_program_are_errors(tmp_path):
    with pytest.raises(prepared.LaunchError, match="FileNotFoundError"):
        _run(["/bin/true"], criu.Placement(cgroup_procs=(str(tmp_path / "no-cgroup" / "cgroup.procs"),)))
    with pytest.raises(FileNotFoundError):
        _run([str(tmp_path / "no-such-program")])
    assert _run(["/bin/true"])[0] == 0  # the helper is still there


def test_a_dead_helper_is_replaced_and_a_forked_caller_gets_its_own():
    first = prepared.launcher()
    assert first is not None
    os.kill(first._proc.pid, signal.SIGKILL)
    first._proc.wait()
    deadline = time.monotonic() + 5
    while first.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _run(["/bin/true"])[0] == 0
    second = prepared.launcher()
    assert second is not None and second is not first and second.alive
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            mine = prepared.launcher()
            ok = mine is not None and mine is not second and _run(["/bin/true"])[0] == 0
            os.write(w, b"1" if ok else b"0")
            if mine is not None:
                mine.close()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
