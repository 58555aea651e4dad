"""Integration: real workspaces (namespaces, overlayfs, cgroups) and their isolation."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.errors import (
    AgentError,
    ImageNotFound,
    InvalidArgument,
    PathNotFound,
    StateConflict,
    WorkspaceNotFound,
)
from bunshin.workspace import Workspace

from .procs import fork_bomb

pytestmark = pytest.mark.integration


@pytest.fixture
def ws(no_leaks):
    w = Workspace.create("host", memory="512M", pids=128, config=no_leaks)
    yield w
    w.remove()


def test_exec_propagates_output_and_exit_code(ws):
    r = ws.exec("echo out; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("out\n", "err\n", 3, False)
    r = ws.exec(["printf", "%s", "a b"], cwd="/tmp", env={"X": "1"})
    assert r.stdout == "a b"
    assert ws.exec("echo $X; pwd", cwd="/tmp", env={"X": "42"}).stdout == "42\n/tmp\n"


def test_hostname_differs_from_host(ws):
    inside = ws.exec(["hostname"]).stdout.strip()
    assert inside and inside != socket.gethostname()
    assert inside == ws.id


def test_pid_namespace_hides_host(ws):
    assert ws.exec(["cat", "/proc/1/comm"]).stdout.strip() != "process_api"
    pids = {int(p) for p in ws.exec("ls /proc").stdout.split() if p.isdigit()}
    assert 1 in pids and len(pids) < 10, pids
    # the host's pid of the test runner is not visible or signalable from inside
    me = os.getpid()
    r = ws.exec(f"kill -0 {me}; echo rc=$?")
    if me not in pids:
        assert "rc=1" in r.stdout
    try:  # may kill itself, never the host
        code = ws.exec("kill -9 -1; echo survived").exit_code
    except AgentError:  # it also kills the agent's helpers serving this very call (only pid 1 is immune)
        code = None
    assert code in (0, -9, 137, None)
    assert ws.exec("echo alive").stdout == "alive\n"  # the agent itself is untouched
    assert os.getpid() == me


def test_writes_stay_inside(ws, tmp_path):
    marker = f"/etc/bunshin-test-{ws.id}"
    assert ws.exec(f"echo secret > {marker} && cat {marker}").stdout == "secret\n"
    assert not Path(marker).exists()
    # the host's own files are readable but not writable through the workspace
    r = ws.exec("echo x >> /etc/hostname; echo rc=$?")
    assert "rc=0" in r.stdout and "x" not in Path("/etc/hostname").read_text().splitlines()[-1:]


def test_bunshin_state_is_hidden(ws):
    assert ws.config.db_path.exists()
    assert ws.exec(["test", "-e", str(ws.config.db_path)]).exit_code == 1
    assert ws.exec("ls -A /var/lib/bunshin 2>/dev/null | wc -l").stdout.strip() == "0"
    assert ws.exec(["test", "-e", str(ws.config.tmpfs)]).exit_code == 1


def test_only_loopback(ws):
    ifaces = ws.exec("ls /sys/class/net 2>/dev/null || cat /proc/net/dev").stdout
    names = {line.split(":")[0].strip() for line in ifaces.splitlines() if ":" in line} or set(ifaces.split())
    assert names == {"lo"}, ifaces
    r = ws.exec(["python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); print('ok')"])
    assert r.stdout.strip() == "ok"


def test_tmp_run_dev_are_private_folders_of_the_upper(ws, tmp_path):
    """No tmpfs inside (CRIU would tar each at every fork): /tmp, /run, /dev live in the upper."""
    marker = Path("/tmp") / f"bunshin-host-{os.getpid()}"
    marker.write_text("host")
    try:
        script = (
            f"test ! -e {marker} && stat -c '%a' /tmp /dev/shm /run /dev && "
            "echo hi > /dev/null && head -c 3 /dev/zero | od -An -tx1 && "
            "echo x > /tmp/f && echo y > /dev/shm/g && "
            "awk '$2 ~ \"^/(tmp|run|dev)(/shm)?$\" {print $2, $3}' /proc/mounts"
        )
        r = ws.exec(["sh", "-c", script])
    finally:
        marker.unlink()
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[:4] == ["1777", "1777", "755", "755"]
    assert lines[4].split() == ["00", "00", "00"]
    assert lines[5:] == [""]  # none of them is a mount
    upper = Path(ws.record.upper)
    assert (upper / "tmp" / "f").read_text() == "x\n" and (upper / "dev" / "shm" / "g").read_text() == "y\n"
    assert "devpts" in ws.exec(["sh", "-c", "grep ' /dev/pts ' /proc/mounts"]).stdout


def test_proc_sys_is_read_only(ws):
    r = ws.exec("echo 1 > /proc/sys/vm/drop_caches; echo rc=$?")
    assert "rc=0" not in r.stdout


def test_cannot_mount(ws):
    r = ws.exec("mount -t tmpfs x /mnt; echo rc=$?")
    assert "rc=0" not in r.stdout


def test_timeout_kills_process_group(ws):
    t0 = time.monotonic()
    r = ws.exec("sleep 100 & sleep 100; echo never", timeout=1)
    assert r.timed_out and "never" not in r.stdout
    assert time.monotonic() - t0 < 10
    assert "sleep" not in ws.exec("ps -eo comm").stdout


def test_files_roundtrip_and_errors(ws):
    ws.files.write("/work/a/b.txt", b"\x00\x01bytes")
    assert ws.files.read("/work/a/b.txt") == b"\x00\x01bytes"
    assert [e.name for e in ws.files.list("/work/a")] == ["b.txt"]
    with pytest.raises(PathNotFound):
        ws.files.read("/nope/missing")
    with pytest.raises(FileNotFoundError):
        ws.files.list("/nope")


def test_session_keeps_state(ws):
    with ws.shell() as sh:
        sh.run("cd /tmp && export A=1 && B=2 && f() { echo fn$1; }")
        r = sh.run("echo $PWD $A $B; f x")
        assert r.output.strip().splitlines() == ["/tmp 1 2", "fnx"]
        assert sh.run("false").exit_code == 1
        r = sh.run("sleep 30", timeout=1)
        assert r.timed_out
        assert sh.run("echo still $A").output.strip() == "still 1"


def test_fork_bomb_stops_at_pids_limit(no_leaks):
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as w:
        r, peak = fork_bomb(w)
        assert r.timed_out
        assert 32 < peak <= 64, peak
        # the host is fine, and the workspace recovers once the bomb's group is killed
        assert subprocess.run(["true"]).returncode == 0
        assert w.exec(["echo", "ok"], timeout=10).stdout == "ok\n"


def test_memory_hog_is_killed_inside_its_cgroup(no_leaks):
    with Workspace.create("host", memory="128M", pids=64, config=no_leaks) as hog, \
         Workspace.create("host", memory="128M", pids=64, config=no_leaks) as other:
        r = hog.exec(["python3", "-c", "x = bytearray(512 << 20); print('allocated')"], timeout=60)
        assert "allocated" not in r.stdout and r.exit_code != 0
        assert hog.exec(["echo", "agent alive"]).stdout == "agent alive\n"
        assert other.exec(["echo", "neighbour fine"]).stdout == "neighbour fine\n"


def test_long_lived_command(no_leaks):
    with Workspace.create("host", command=["sleep", "1000"], config=no_leaks) as w:
        assert "sleep 1000" in w.exec("ps -eo args").stdout


def test_bad_input_is_clear_and_leaks_nothing(no_leaks):
    with pytest.raises(ImageNotFound):
        Workspace.create("/no/such/image", config=no_leaks)
    with pytest.raises(InvalidArgument):
        Workspace.create("host", memory="lots", config=no_leaks)
    with pytest.raises(InvalidArgument):
        Workspace.create("host", name="bad name!", config=no_leaks)
    with pytest.raises(WorkspaceNotFound):
        Workspace.get("ws-doesnotexist", config=no_leaks)


def test_exec_into_removed_workspace(no_leaks):
    w = Workspace.create("host", config=no_leaks)
    w.remove()
    with pytest.raises(StateConflict):
        w.exec(["true"])
    with pytest.raises(WorkspaceNotFound):
        Workspace.get(w.id, config=no_leaks)


def test_stats(ws):
    st = ws.stats()
    assert st.processes >= 1
    assert st.memory.cgroup_bytes > 0 and st.memory.pss_bytes > 0 and st.memory.uss_bytes > 0


@pytest.fixture(scope="module")
def busybox_root(tmp_path_factory) -> Path:
    """A minimal root filesystem: busybox only, no Python, no C library, no bash."""
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        pytest.skip("busybox-static is not installed (make install installs it)")
    root = tmp_path_factory.mktemp("busybox-root")
    (root / "bin").mkdir()
    subprocess.run(["cp", str(busybox), str(root / "bin" / "busybox")], check=True)
    for applet in ("sh", "ls", "cat", "echo", "hostname", "ps", "sleep", "mkdir", "env", "pwd", "id"):
        (root / "bin" / applet).symlink_to("busybox")
    for d in ("etc", "root", "tmp", "proc", "dev", "run"):
        (root / d).mkdir()
    return root


def test_minimal_image_without_python(no_leaks, busybox_root):
    assert not (busybox_root / "usr").exists()
    with Workspace.create(str(busybox_root), config=no_leaks) as w:
        assert w.exec(["ls", "/"]).exit_code == 0
        assert w.exec("echo $((6*7))").stdout == "42\n"
        assert w.exec(["cat", "/proc/1/cmdline"]).stdout.count("bunshin_agent") == 1
        with w.shell() as sh:  # no bash in the image: the session falls back to sh
            sh.run("cd /tmp; X=7")
            assert sh.run("echo $PWD $X").output.strip() == "/tmp 7"
        w.files.write("/root/f", b"data")
        assert w.files.read("/root/f") == b"data"
