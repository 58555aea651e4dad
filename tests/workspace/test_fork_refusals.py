"""Integration: what CRIU cannot carry is refused before the dump, naming the
process, the object and what to do, and the parent goes on untouched; a restore
that fails anyway names CRIU's first real error."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.errors import CriuError, NotForkable

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"


def _wait_for(ws, path: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while ws.exec(["test", "-e", path]).exit_code != 0:
        assert time.monotonic() < deadline, f"{path} did not appear in {ws.id}"
        time.sleep(0.05)


def _zombie_leader(tmp_path: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    out = tmp_path / "zombie_leader"
    subprocess.run([gcc, "-O2", "-pthread", "-o", str(out), str(PROGS / "zombie_leader.c")], check=True)
    return out


@pytest.mark.parametrize("name", ["", "noname"])
def test_a_zombie_leader_with_running_threads_is_refused(family, tmp_path, name):
    """Named by its command line, which a zombie leader reads empty (a live thread's is read),
    also when it emptied its name (comm) before its main thread exited."""
    ws = family.create(memory="256M")
    ws.files.write("/root/zl", _zombie_leader(tmp_path).read_bytes())
    ws.exec(["chmod", "+x", "/root/zl"])
    argv = ["/root/zl", "/tmp/zl.ready", *([name] if name else [])]
    pid = ws.commands.spawn(argv)
    _wait_for(ws, "/tmp/zl.ready")
    assert ws.exec(["cat", f"/proc/{pid}/comm"]).stdout == ("\n" if name else "zl\n")
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 1)
    err = info.value
    command = " ".join(argv)
    assert f"process {pid} ({command}) is a zombie whose 1 other thread(s) still run" in err.message, err.message
    assert err.details["command"] == command
    assert err.details["process"] == pid and "pthread_join" in (err.hint or "")
    # untouched: the leader is still a zombie and its thread still runs
    stat = ws.exec(["cat", f"/proc/{pid}/stat"]).stdout
    assert stat.rsplit(")", 1)[1].split()[0] == "Z"
    assert len(ws.exec(["ls", f"/proc/{pid}/task"]).stdout.split()) == 2
    # once it has ended, the workspace forks
    ws.exec(["kill", "-9", str(pid)])
    deadline = time.monotonic() + 10
    while ws.exec(["test", "-e", f"/proc/{pid}/task/{pid + 1}"]).exit_code == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    (clone,) = family.fork(ws, 1)
    assert clone.exec(["echo", "ok"]).stdout == "ok\n"


def test_a_failing_restore_names_criu_first_error(family):
    ws = family.create(memory="256M")
    snap = family.snapshot(ws)
    images = Path(snap.record.images)
    victim = sorted(images.glob("mm-*.img"))[-1]  # a task's memory map, read late in the restore
    data = bytearray(victim.read_bytes())
    for i in range(8, len(data)):
        data[i] ^= 0x5A
    victim.write_bytes(bytes(data))
    with pytest.raises(CriuError) as info:
        family.restore(snap, 1)
    err = info.value
    first = err.first_errors.splitlines()[0]
    assert victim.name in first and first in err.message  # the damaged image, named in the message
    assert "Restoring FAILED" not in first and "RLIMIT_NOFILE" not in err.first_errors
    assert err.details["action"] == "restore" and err.details["log"] in str(err)
    assert ws.exec(["echo", "parent"]).stdout == "parent\n"  # the source goes on


# Programs that hold what CRIU has no dumper for; each writes /tmp/held once it does
# (or /tmp/unsupported with the errno when this kernel lacks the feature).
LANDLOCK = r"""
import ctypes, struct, time
libc = ctypes.CDLL(None, use_errno=True)
attr = ctypes.create_string_buffer(struct.pack("QQ", 1, 0))  # handled_access_fs: execute
fd = libc.syscall(444, attr, 16, 0)  # landlock_create_ruleset
open("/tmp/held" if fd >= 0 else "/tmp/unsupported", "w").write(str(fd if fd >= 0 else ctypes.get_errno()))
time.sleep(1000)
"""
SECRETMEM = r"""
import ctypes, mmap, os, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(447, 0)  # memfd_secret
if fd < 0:
    open("/tmp/unsupported", "w").write(str(ctypes.get_errno()))
else:
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    m[:6] = b"secret"
    open("/tmp/held", "w").write(str(fd))
time.sleep(1000)
"""


@pytest.mark.parametrize(("program", "what"), [
    (LANDLOCK, "holds a [landlock-ruleset] descriptor (fd "),
    (SECRETMEM, "holds secret memory (memfd_secret, fd "),
])
def test_a_descriptor_criu_cannot_dump_is_refused(family, program, what):
    ws = family.create(memory="256M")
    ws.files.write("/root/hold.py", program.encode())
    pid = ws.commands.spawn(["python3", "/root/hold.py"])
    deadline = time.monotonic() + 30
    while ws.exec(["sh", "-c", "test -e /tmp/held || test -e /tmp/unsupported"]).exit_code != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    if ws.exec(["test", "-e", "/tmp/unsupported"]).exit_code == 0:
        pytest.skip(f"this kernel lacks it (errno {ws.files.read_text('/tmp/unsupported')})")
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 1)
    err = info.value
    assert f"process {pid} (python3 /root/hold.py) {what}{ws.files.read_text('/tmp/held')})" in err.message
    assert err.details["process"] == pid and "before forking" in (err.hint or "")
    assert ws.exec(["kill", "-0", str(pid)]).exit_code == 0  # untouched


def test_a_traced_process_is_refused_naming_its_tracer(family):
    if shutil.which("strace") is None:
        pytest.skip("needs strace (the host image's)")
    ws = family.create(memory="256M")
    tracer = ws.commands.spawn(["strace", "-o", "/dev/null", "sh", "-c", "touch /tmp/traced; exec sleep 1000"])
    _wait_for(ws, "/tmp/traced")
    with pytest.raises(NotForkable) as info:
        family.fork(ws, 1)
    err = info.value
    assert f"is traced by process {tracer} (strace -o /dev/null sh -c" in err.message
    assert "sleep 1000" in err.details["command"] and "detach the tracer" in (err.hint or "")
    tracee = err.details["process"]
    ws.exec(["kill", "-9", str(tracer)])  # a dead tracer's tracees run on, untraced
    deadline = time.monotonic() + 10
    while "TracerPid:\t0" not in ws.files.read_text(f"/proc/{tracee}/status"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (clone,) = family.fork(ws, 1)
    assert clone.exec(["pgrep", "-x", "sleep"]).exit_code == 0
