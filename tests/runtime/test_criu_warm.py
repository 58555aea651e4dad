"""Restores by a warm criu: a ``criu swrk`` the launcher exec'd ahead in a fresh network
namespace, a copy of the small mount namespace and a keyring of its own, given the
restore's mounts, sysfs and cgroups from outside, then asked over RPC (``criu.restore``
with a placement ``prepared.rpc_fits``); and the command it falls back to."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bunshin.errors import CriuError
from bunshin.runtime.criu import prepared, zygote
from bunshin.runtime.criu import run as criu

from .procs import kill_and_wait
from .test_criu import Counters, _scramble, counters, criu_bin, workdir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.criu


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A pids cgroup of this test's (v1 or v2), emptied and removed after it."""
    base = Path("/sys/fs/cgroup/pids")
    if not (base / "cgroup.procs").exists():
        base = Path("/sys/fs/cgroup/unified")
    if not (base / "cgroup.procs").exists():
        base = Path("/sys/fs/cgroup")
    cg = base / f"bunshin-test-warm-{os.getpid()}"
    cg.mkdir()
    yield cg
    for _ in range(100):
        for pid in (cg / "cgroup.procs").read_text().split():
            kill_and_wait(int(pid))
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.05)


def _placement(folder: Path, cgroup: Path | None = None, *more: tuple[str, bool]) -> criu.Placement:
    return criu.Placement(new_netns=True, own_keyring=True, own_mounts=((str(folder), True), *more),
                          cgroup_procs=() if cgroup is None else (str(cgroup / "cgroup.procs"),))


def _warm_criu() -> list[psutil.Process]:
    """The launcher's idle warm criu processes (``criu swrk``, not yet asked)."""
    lch = prepared.launcher()
    assert lch is not None
    found = []
    for p in psutil.Process(lch._proc.pid).children():
        try:
            if "swrk" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_pool(size: int, timeout: float = 10) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        found = _warm_criu()
        if len(found) >= size or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_a_warm_criu_restores_into_the_clones_cgroup_and_fresh_namespaces(counters, criu_bin, workdir, cgroup):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    at_dump = counters.value(pid)
    clones = []
    for i in range(3):  # more than the pool holds: its first one is made on the first's path
        pidfile = workdir / f"clone{i}.pid"
        r = criu.restore(criu_bin, images, pidfile=pidfile, placement=_placement(workdir, cgroup))
        assert r.pid is not None and r.pid not in (pid, *clones)
        assert not pidfile.exists()  # the warm criu's answer gave the pid, no command wrote it
        counters.pids.append(r.pid)
        clones.append(r.pid)
    host_net, host_mnt = os.readlink("/proc/self/ns/net"), os.readlink("/proc/self/ns/mnt")
    nets = {os.readlink(f"/proc/{c}/ns/net") for c in clones}
    assert len(nets) == 3 and host_net not in nets  # one fresh namespace each
    assert all(os.readlink(f"/proc/{c}/ns/mnt") != host_mnt for c in clones)
    assert {int(p) for p in (cgroup / "cgroup.procs").read_text().split()} >= set(clones)
    for c in clones:
        assert counters.value(c) <= at_dump + 10_000 and counters.wait_above(c, counters.value(c))
    pool = _wait_pool(zygote.CRIU_POOL)
    assert len(pool) == zygote.CRIU_POOL
    for p in pool:  # ready ones wait in namespaces of their own, in no clone's cgroup
        assert os.readlink(f"/proc/{p.pid}/ns/net") not in (host_net, *nets)
        assert os.readlink(f"/proc/{p.pid}/ns/mnt") != host_mnt
        assert p.pid not in {int(x) for x in (cgroup / "cgroup.procs").read_text().split()}


@pytest.mark.parametrize("level", [2, 4])  # -v2 lines carry no timestamp
def test_a_failed_warm_restore_names_criu_first_real_error(counters, criu_bin, workdir, level):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    (mm,) = images.glob("mm-*.img")
    _scramble(mm)
    with pytest.raises(CriuError) as info:
        criu.restore(criu_bin, images, pidfile=workdir / "x.pid", log_name="restore.log",
                     placement=_placement(workdir), log_level=level)
    err = info.value
    assert err.details["action"] == "restore" and err.details["log"] == str(images / "restore.log")
    assert err.first_errors.startswith("task 1: ") and mm.name in err.first_errors.splitlines()[0]
    assert counters.value(pid) > 0  # the dumped task was never touched


def test_an_idle_warm_criu_that_dies_is_replaced(counters, criu_bin, workdir):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    first = criu.restore(criu_bin, images, pidfile=workdir / "a.pid", placement=_placement(workdir))
    counters.pids.append(first.pid or 0)
    pool = _wait_pool(zygote.CRIU_POOL)
    assert pool
    assert all(p.nice() == 0 for p in pool)  # not the helper's own nice value (``zygote.NICE``)
    assert all(p.environ().get("GNUTLS_NO_IMPLICIT_INIT") == "1" for p in pool)  # criu_launch.env
    for p in pool:
        p.kill()
    r = criu.restore(criu_bin, images, pidfile=workdir / "b.pid", placement=_placement(workdir))
    assert r.pid is not None and counters.value(r.pid) > 0
    counters.pids.append(r.pid)
    fresh = _wait_pool(zygote.CRIU_POOL)
    assert len(fresh) == zygote.CRIU_POOL and not {p.pid for p in fresh} & {p.pid for p in pool}


def test_a_mount_the_warm_criu_cannot_take_falls_back_to_the_command(counters, criu_bin, workdir, tmp_path_factory):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    prepared.launcher()  # started before the mount below: its small namespace lacks it
    fresh = tmp_path_factory.mktemp("fresh")  # beside the restore's folder, not beneath it
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "bunshin-test-fresh", str(fresh)], check=True)
    try:
        (fresh / "inner").mkdir()
        pidfile = workdir / "c.pid"
        r = criu.restore(criu_bin, images, pidfile=pidfile,
                         placement=_placement(workdir, None, (str(fresh / "inner"), False)))
        assert r.pid is not None and pidfile.read_text().strip() == str(r.pid)  # the command's pidfile
        counters.pids.append(r.pid)
        assert counters.value(r.pid) > 0
    finally:
        subprocess.run(["umount", "-l", str(fresh)], check=False)


def test_a_placement_it_cannot_take_and_a_script_criu_run_as_commands(tmp_path):
    assert prepared.rpc_fits(_placement(tmp_path))
    assert not prepared.rpc_fits(criu.Placement(new_netns=True, own_keyring=True))  # no mounts of its own
    assert not prepared.rpc_fits(criu.Placement(new_netns=True, own_mounts=(("/x", True),)))  # the caller's keyring
    held = criu.Placement(new_netns=True, own_keyring=True, own_mounts=(("/x", True),), sysfs="/s", hold_netns=True)
    assert not prepared.rpc_fits(held) and not prepared.rpc_fits(None)
    script = tmp_path / "criu"
    script.write_text("#!/bin/sh\nexec criu \"$@\"\n")
    from bunshin.runtime.criu import launch as criu_launch

    assert not criu_launch.warmable(script) and criu_launch.warmable(Path("/bin/true"))


def test_the_log_level_reaches_criu_on_both_paths(counters, criu_bin, workdir):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    for name, placement in (("warm", _placement(workdir)), ("command", None)):
        for level in (2, 4):
            r = criu.restore(criu_bin, images, pidfile=workdir / f"{name}{level}.pid", placement=placement,
                             log_name=f"{name}-{level}.log", log_level=level)
            assert r.pid is not None
            counters.pids.append(r.pid)
            text = r.log.read_text()
            assert ("Reading image tree" in text) == (level == 4), (name, level)  # a debug line
            assert len(text.splitlines()) < 50 or level == 4


def test_warm_restores_leave_no_descriptor_or_pending_entry(counters, criu_bin, workdir):  # noqa: F811
    pid = counters.spawn()
    images = workdir / "img"
    criu.dump(criu_bin, pid, images)
    counters.pids.append(criu.restore(criu_bin, images, pidfile=workdir / "0.pid", placement=_placement(workdir)).pid
                         or 0)  # the launcher and its pool started
    lch = prepared.launcher()
    assert lch is not None
    fds = len(os.listdir("/proc/self/fd"))
    for i in range(4):
        r = criu.restore(criu_bin, images, pidfile=workdir / f"{i}.pid", placement=_placement(workdir))
        counters.pids.append(r.pid or 0)
        assert r.pid is not None and psutil.pid_exists(r.pid)
    assert len(os.listdir("/proc/self/fd")) == fds  # the RPC sockets and pidfds handed over are closed
    assert not lch._pending  # every request is forgotten once its criu is gone



_SPAWN = """
import json, os, socket, sys
sys.path.insert(0, sys.argv[1])
from bunshin.runtime.criu import zygote
sc = zygote._load_syscalls()
host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
ns = zygote.Namespaces(host, zygote.small_namespace(sc, host), net, zygote.sized_netns(sc, net))
leak = os.open("/", os.O_RDONLY)
os.set_inheritable(leak, True)  # as a descriptor received over SCM_RIGHTS is
mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
os.setpriority(os.PRIO_PROCESS, 0, -5)
pid, mnt, cnet = zygote.spawn_warm_criu(sc, ["/bin/sleep", "30"], theirs.fileno(), ns)
for _ in range(500):  # until it sleeps: its loader's own descriptors are closed then
    if open(f"/proc/{pid}/syscall").read().split()[0] in ("35", "230"):
        break
    __import__("time").sleep(0.01)
fds = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
print(json.dumps({"fds": fds, "sid": os.getsid(pid), "pid": pid, "nice": os.getpriority(os.PRIO_PROCESS, pid),
                  "my_nice": os.getpriority(os.PRIO_PROCESS, 0),
                  "net": os.readlink(f"/proc/{pid}/ns/net"), "mnt": os.readlink(f"/proc/{pid}/ns/mnt"),
                  "held": [os.readlink(f"/proc/self/fd/{mnt}"), os.readlink(f"/proc/self/fd/{cnet}")],
                  "my_net": os.readlink("/proc/self/ns/net"), "my_mnt": os.readlink("/proc/self/ns/mnt")}))
os.kill(pid, 9)
os.waitpid(pid, 0)
"""


def test_a_warm_criu_is_spawned_with_only_its_socket_and_the_helper_stays_where_it_was():
    """``zygote.spawn_warm_criu`` in a helper-like process: the spawned command holds its
    socket and /dev/null only (not an inheritable descriptor of the helper's), runs in its
    own session at nice 0 in namespaces the helper made and left."""
    import json

    root = str(Path(zygote.__file__).parents[3])
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", _SPAWN, root], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    fds = {int(k): v for k, v in r["fds"].items()}
    assert set(fds) == {0, 1, 2, zygote.PASSED_FD}, fds  # nothing of the helper's
    assert {fds[0], fds[1], fds[2]} == {"/dev/null"} and fds[zygote.PASSED_FD].startswith("socket:")
    assert r["sid"] == r["pid"] and r["nice"] == 0 and r["my_nice"] == -5
    assert r["net"] != r["my_net"] and r["mnt"] != r["my_mnt"]  # the helper is back in its own
    assert r["held"] == [r["mnt"], r["net"]]  # and holds the command's, for its placement
    assert r["my_net"] == os.readlink("/proc/self/ns/net") and r["my_mnt"] == os.readlink("/proc/self/ns/mnt")
