"""The criu launcher: commands forked by the warm helper, each in its own fresh network namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from bunshin.runtime.criu import prepared
from bunshin.runtime.criu import run as criu
from bunshin.runtime.kernel import syscalls as sc

pytestmark = pytest.mark.integration


def _run(argv: list[str], placement: criu.Placement | None = None, timeout: float | None = 10) -> tuple[int, bool, str]:
    with tempfile.TemporaryFile() as out:
        ran = prepared.run(argv, placement, out.fileno(), timeout)
        assert ran is not None, "the launcher did not start"
        out.seek(0)
        return ran[0], ran[1], out.read().decode()


def test_every_run_gets_a_fresh_network_namespace_of_its_own(tmp_path):
    own = os.readlink("/proc/self/ns/net")
    # each run binds its namespace to a file, so that it stays (a freed one's number is given again)
    script = ("readlink /proc/self/ns/net; cat /proc/sys/net/ipv4/ip_unprivileged_port_start; cat /proc/net/dev; "
              "cat /proc/sys/net/ipv4/tcp_ehash_entries; touch $0; mount --bind /proc/self/ns/net $0")
    seen = []
    try:
        for i in range(4):  # more than the warm pool holds
            code, timed_out, out = _run(["/bin/sh", "-c", script, str(tmp_path / f"ns{i}")],
                                        criu.Placement(new_netns=True))
            assert (code, timed_out) == (0, False), out
            ns, port_start, *dev, buckets = out.splitlines()
            assert ns != own and port_start == "0" and any(line.strip().startswith("lo:") for line in dev)
            assert int(buckets) == sc.NETNS_TCP_BUCKETS  # a TCP table of its own, of that size
            seen.append(ns)
        assert len(set(seen)) == 4  # never one namespace for two runs
    finally:
        for i in range(4):
            subprocess.run(["umount", str(tmp_path / f"ns{i}")], check=False, capture_output=True)
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


# ------------------------------------------------ the small mount namespace of a restore


def _mount_points(text: str) -> list[str]:
    return [line.split()[4] for line in text.splitlines() if len(line.split()) > 4]


@pytest.fixture
def clone_mounts(tmp_path):
    """Mounts made the way a clone's are (a ``bunshin-upper`` tmpfs, an overlay root on
    it), ``clone_mounts(name)`` makes one more; all unmounted after the test."""
    from bunshin.runtime.kernel import syscalls as sc
    made: list[str] = []

    def make(name: str) -> str:
        wdir = tmp_path / name
        wdir.mkdir()
        sc.mount("bunshin-upper", str(wdir), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, "mode=0755,size=1m")
        made.append(str(wdir))
        for d in ("upper", "work", "root", "lower", "sys"):
            (wdir / d).mkdir()
        (wdir / "lower" / "in-lower").write_text("lower")
        sc.mount("overlay", str(wdir / "root"), "overlay", 0,
                 f"lowerdir={wdir}/lower,upperdir={wdir}/upper,workdir={wdir}/work")
        made.append(str(wdir / "root"))
        return str(wdir)

    yield make
    for point in reversed(made):
        subprocess.run(["umount", "-l", point], check=False)


def test_a_restore_runs_in_a_small_mount_namespace_holding_only_its_own_clones_mounts(clone_mounts):
    others = [clone_mounts(f"other-{i}") for i in range(20)]  # before the helper starts: dropped from its copy
    lch = prepared.CriuLauncher.start()
    try:
        late = [clone_mounts(f"late-{i}") for i in range(20)]  # after: never propagated to it
        mine = clone_mounts("mine")
        host_before = Path("/proc/self/mountinfo").read_text()
        script = f"cat /proc/self/mountinfo; echo made > {mine}/root/by-criu; cat {mine}/root/in-lower"
        into = criu.Placement(new_netns=True, sysfs=f"{mine}/sys", own_mounts=((mine, True),))
        code, out = _spawn(lch, ["/bin/sh", "-c", script], into)
        assert code == 0, out
        seen = _mount_points(out)
        assert mine in seen and f"{mine}/root" in seen and f"{mine}/sys" in seen  # its own, at the same paths
        assert not any(p in seen for p in [*others, *late])  # no other clone's
        assert not any(line.split(" - ")[-1].startswith(("overlay", "tmpfs bunshin-upper")) for line in out.splitlines()
                       if line.split()[4:5] and not line.split()[4].startswith(mine))
        assert len(seen) <= len(_mount_points(host_before)) - 79  # 80 other clones' mounts fewer, its sysfs more
        assert out.rstrip().endswith("lower")
        assert Path(mine, "root", "by-criu").read_text() == "made\n"  # the host reaches what it wrote
        host_after = Path("/proc/self/mountinfo").read_text()
        assert f"{mine}/sys" not in _mount_points(host_after)  # its sysfs stayed in its namespace
        ours = str(Path(mine).parent)  # (other engineers' workspaces come and go beside ours)
        assert [p for p in _mount_points(host_after) if p.startswith(ours)] == \
            [p for p in _mount_points(host_before) if p.startswith(ours)]
    finally:
        lch.close()


def test_without_its_mounts_or_with_a_path_it_lacks_a_command_runs_in_the_hosts_namespace(clone_mounts, tmp_path):
    lch = prepared.CriuLauncher.start()
    try:
        mine = clone_mounts("mine")
        host = os.readlink("/proc/self/ns/mnt")
        code, out = _spawn(lch, ["/bin/sh", "-c", "readlink /proc/self/ns/mnt"], criu.Placement(new_netns=True))
        assert (code, out.strip()) == (0, host)
        # a folder made after the helper started on a mount it dropped: not in its namespace
        fresh = clone_mounts("fresh-parent")
        Path(fresh, "inner").mkdir()
        code, out = _spawn(lch, ["/bin/sh", "-c", "readlink /proc/self/ns/mnt"],
                           criu.Placement(new_netns=True, own_mounts=((mine, True), (f"{fresh}/inner", False))))
        assert (code, out.strip()) == (0, host)
        code, out = _spawn(lch, ["/bin/sh", "-c", "readlink /proc/self/ns/mnt"],
                           criu.Placement(new_netns=True, own_mounts=((str(tmp_path / "missing"), False),)))
        assert (code, out.strip()) == (0, host)  # a tree that cannot be made: the host's namespace
    finally:
        lch.close()


def test_a_planted_symlink_is_not_followed_into_the_namespace(clone_mounts, tmp_path):
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret").write_text("host secret")
    lch = prepared.CriuLauncher.start()
    try:
        mine = clone_mounts("mine")
        Path(mine, "root", "link").symlink_to(canary)  # written through the clone's root
        code, out = _spawn(lch, ["/bin/sh", "-c", "cat /proc/self/mountinfo; readlink /proc/self/ns/mnt"],
                           criu.Placement(new_netns=True, own_mounts=((mine, True), (f"{mine}/root/link", False))))
        assert code == 0
        assert str(canary) not in out and "host secret" not in out  # the canary was never mounted
    finally:
        lch.close()
    assert (canary / "secret").read_text() == "host secret"


def _spawn(lch: prepared.CriuLauncher, argv: list[str], placement: criu.Placement) -> tuple[int, str]:
    with tempfile.TemporaryFile() as out:
        rid, pending = lch.spawn(argv, prepared.placement_fields(placement), out.fileno())
        code = lch.wait(rid, pending, 10)
        out.seek(0)
        assert code is not None
        return code, out.read().decode()


def test_the_warm_pool_is_made_ahead_and_refilled_after_each_exec():
    import psutil

    from bunshin.runtime.criu import zygote

    lch = prepared.CriuLauncher.start()
    try:
        helper = psutil.Process(lch._proc.pid)
        host_net = os.readlink("/proc/self/ns/net")

        held: list[int] = []  # namespaces seen stay open: a freed one's number can be given again

        def warm() -> list[str]:
            deadline = time.monotonic() + 10
            while True:
                nets = []
                for p in helper.children():  # a child that ran its command may end while it is looked at
                    try:
                        if p.status() != psutil.STATUS_ZOMBIE:
                            fd = os.open(f"/proc/{p.pid}/ns/net", os.O_RDONLY)
                            held.append(fd)
                            nets.append(os.readlink(f"/proc/self/fd/{fd}"))
                    except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                        pass
                if (len(nets) == zygote.POOL and host_net not in nets) or time.monotonic() > deadline:
                    return nets
                time.sleep(0.01)

        before = warm()  # before any request
        assert len(before) == zygote.POOL and host_net not in before
        for _ in range(3):
            assert _spawn(lch, ["/bin/true"], criu.Placement(new_netns=True))[0] == 0
        after = warm()
        assert len(after) == zygote.POOL and not set(after) & set(before)  # used ones replaced by fresh ones
    finally:
        for fd in held:
            os.close(fd)
        lch.close()


def test_the_helper_runs_at_its_nice_value_and_everything_it_starts_at_zero():
    from bunshin.runtime.criu import zygote

    lch = prepared.CriuLauncher.start()
    try:
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, lch._proc.pid) != zygote.NICE and time.monotonic() < deadline:
            time.sleep(0.01)  # set as it starts
        assert os.getpriority(os.PRIO_PROCESS, lch._proc.pid) == zygote.NICE != 0
        # a command in the host's namespaces (forked on request) and one in a fresh network
        # namespace (a warm child made ahead) each print their own nice value
        for placement in (None, criu.Placement(new_netns=True)):
            code, out = _spawn(lch, ["/bin/sh", "-c", "cut -d' ' -f19 /proc/self/stat"], placement)
            assert (code, out.strip()) == (0, "0")
    finally:
        lch.close()


def test_a_placement_reaches_the_helper_as_plain_fields():
    import dataclasses

    p = criu.Placement(new_netns=True, own_keyring=True, sysfs="/s", cgroup_procs=("/a", "/b"),
                       own_mounts=(("/x", True), ("/y", False)), utsns="/proc/1/ns/uts")
    fields = prepared.placement_fields(p)
    assert set(fields) == {f.name for f in dataclasses.fields(p)} and prepared.placement_fields(None) == {}
    assert fields["cgroup_procs"] == ["/a", "/b"] and fields["utsns"] == "/proc/1/ns/uts"
    assert [list(m) for m in fields["own_mounts"]] == [["/x", True], ["/y", False]]
    assert isinstance(p.cgroup_procs, tuple)  # the placement itself is left as it was
