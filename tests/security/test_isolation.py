"""Attacks from inside a workspace on the host's privilege, keyring, pid 1 and limits.

Each test runs as root inside a real workspace and, where it matters, in a live
clone of one too (a CRIU restore must bring every protection back). What must hold:
nothing inside gains a capability in the host's user namespace, reaches pid 1 (the
agent, which talks to the host), shares a key with the host, or kills the agent.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from pathlib import Path

import pytest

from bunshin.runtime.container import lifecycle as container
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]

ID_BASE = 1_000_000_000  # Config.id_base: what workspaces write is stored as these ids

PROBE = r'''
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(nr, *args):
    ret = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return 0 if ret >= 0 else ctypes.get_errno()

def opened(path, mode="rb"):
    try:
        with open(path, mode) as f:
            return f.read(64) if "r" in mode else f.write(b"x")
    except OSError as e:
        return e.errno

out = {}
for name in sys.argv[1:]:
    out[name] = eval(name)
print(json.dumps(out, default=lambda b: b.decode("latin-1")))
'''


@pytest.fixture(params=["parent", "clone"])
def ws(request, no_leaks):
    parent = Workspace.create("host", memory="256M", pids=128, config=no_leaks)
    made = [parent]
    try:
        if request.param == "clone":
            made += parent.fork(1)
        target = made[-1]
        target.files.write("/tmp/probe.py", PROBE)
        yield target
    finally:
        for w in reversed(made):
            w.remove()


def probe(ws: Workspace, *exprs: str) -> dict:
    r = ws.exec(["python3", "/tmp/probe.py", *exprs], timeout=30)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_pid1_cannot_be_ptraced_read_or_limited(ws):
    got = probe(
        ws,
        "call(101, 16, 1, 0, 0)",  # ptrace(PTRACE_ATTACH, 1)
        "call(101, 0x4206, 1, 0, 0)",  # ptrace(PTRACE_SEIZE, 1)
        "opened('/proc/1/mem', 'r+b')",
        "opened('/proc/1/environ')",
        "opened('/proc/1/fd/0')",
        "call(310, 1, 0, 0, 0, 0, 0)",  # process_vm_readv(1, ...)
        "call(302, 1, 7, 0, 0)",  # prlimit64(1, RLIMIT_NOFILE, ...)
        "call(434, 1, 0)",  # pidfd_open(1)
    )
    assert set(got.values()) <= {errno.EPERM, errno.EACCES}, got
    status = ws.exec(["grep", "-E", "^Cap(Eff|Prm):", "/proc/self/status"]).stdout
    for line in status.splitlines():
        caps = int(line.split()[1], 16)
        assert not caps & (1 << 19), f"a command holds CAP_SYS_PTRACE: {line}"  # noqa: PLR2004


def test_root_inside_holds_no_host_privilege(ws):
    rec = ws.record
    with open(f"/proc/{rec.pid}/status") as f:
        uids = next(ln for ln in f if ln.startswith("Uid:")).split()[1:]
    # pid 1 is an unprivileged host user of a range of its own (``idranges``), above the stored one
    assert rec.ids is not None and rec.ids >= ID_BASE + 65536 and (rec.ids - ID_BASE) % 65536 == 0
    assert uids == [str(rec.ids)] * 4
    assert Path(f"/proc/{rec.pid}/uid_map").read_text().split() == ["0", str(rec.ids), "65536"]
    assert ws.exec("id -u").stdout.strip() == "0"
    # the original escape: a block device of the host disk, a mount, a user namespace
    dev = os.stat("/").st_dev
    r = ws.exec(f"mknod /tmp/disk b {os.major(dev)} {os.minor(dev)}; echo rc=$?")
    assert "rc=0" not in r.stdout and not ws.exec("test -e /tmp/disk").exit_code == 0
    assert ws.exec("mount -t tmpfs none /mnt").exit_code != 0
    assert ws.exec("mount -t cgroup -o memory none /mnt").exit_code != 0
    assert ws.exec("unshare -U -r true").exit_code != 0
    assert ws.exec("unshare -m true").exit_code != 0
    # the cgroup hierarchies are not there to write, and the workspace stays in its cgroup
    assert ws.exec("ls /sys/fs/cgroup").stdout.strip() == ""
    assert ws.exec("mkdir /sys/fs/cgroup/x").exit_code != 0
    pid_inside = ws.exec("sleep 60 >/dev/null 2>&1 & echo $!").stdout.strip()
    host_pid = next(p for p in _tree(rec.pid) if _ns_pid(p) == pid_inside)
    assert rec.id in Path(f"/proc/{host_pid}/cgroup").read_text()


def test_setuid_files_made_inside_are_not_host_root(ws):
    assert ws.exec("cp /bin/sh /tmp/sush && chmod 4755 /tmp/sush && ls -l /tmp/sush").exit_code == 0
    host_copy = Path(ws.record.upper) / "tmp" / "sush"
    st = host_copy.lstat()
    assert st.st_uid == ID_BASE and st.st_uid != 0  # stored as the layers' range (seen through a view)
    assert ws.exec("/tmp/sush -c 'cat /proc/self/status' | grep -E '^Uid:'").stdout.split()[1:] == ["0"] * 4


def test_keyring_is_not_shared_with_the_host(ws):
    desc = f"bunshin-canary-{os.getpid()}-{ws.id}"
    key = _add_key(desc, b"host secret")
    try:
        got = probe(
            ws,
            "call(250, 0, -3, 0)",  # keyctl(KEYCTL_GET_KEYRING_ID, @s)
            f"call(249, id(b'user'), id(b'{desc}'), 0, 0)",  # request_key: refused before it reads
            "call(248, 0, 0, 0, 0, -3)",  # add_key
            "opened('/proc/keys')",
            "opened('/proc/key-users')",
        )
        assert got["call(250, 0, -3, 0)"] == errno.EPERM
        assert got["call(248, 0, 0, 0, 0, -3)"] == errno.EPERM
        assert got[f"call(249, id(b'user'), id(b'{desc}'), 0, 0)"] == errno.EPERM
        assert desc not in str(got["opened('/proc/keys')"]) and got["opened('/proc/keys')"] in ("", errno.EACCES)
        assert ws.exec(f"grep -r {desc} /proc/keys /proc/key-users; echo rc=$?").stdout.strip().endswith("rc=1") \
            or ws.exec(f"grep -r {desc} /proc/keys").exit_code != 0
    finally:
        _keyctl(3, key)  # KEYCTL_REVOKE


def test_seccomp_refuses_escape_syscalls(ws):
    refused = {
        "bpf": "call(321, 0, 0, 0)",
        "perf_event_open": "call(298, 0, 0, -1, -1, 0)",
        "userfaultfd": "call(323, 0)",
        "io_uring_setup": "call(425, 1, 0)",
        "unshare(CLONE_NEWUSER)": "call(272, 0x10000000)",
        "clone(CLONE_NEWUSER)": "call(56, 0x10000000 | 17, 0, 0, 0, 0)",
        "setns": "call(308, 0, 0)",
        "acct": "call(163, 0)",
        "syslog": "call(103, 3, 0, 0)",
        "kexec_load": "call(246, 0, 0, 0, 0)",
        "init_module": "call(175, 0, 0, 0)",
        "open_by_handle_at": "call(304, 0, 0, 0)",
        "x32 getpid": "call(39 | 0x40000000)",
    }
    got = probe(ws, *refused.values(), "call(435, 0, 0)", "call(39)", "call(272, 0x00020000)")
    for name, expr in refused.items():
        assert got[expr] == errno.EPERM, f"{name}: {got[expr]}"
    assert got["call(435, 0, 0)"] == errno.ENOSYS  # clone3: libc falls back to clone
    assert got["call(39)"] == 0  # getpid: ordinary calls work
    assert got["call(272, 0x00020000)"] == errno.EPERM  # unshare(CLONE_NEWNS): no CAP_SYS_ADMIN
    status = ws.exec("grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status").stdout.split()
    assert status == ["NoNewPrivs:", "1", "Seccomp:", "2"]


def test_seccomp_refuses_vsock_alg_and_unknown_address_families(ws):
    """A VM's channel to its hypervisor (AF_VSOCK) and the kernel's crypto API (AF_ALG) are
    refused as "not supported", as a kernel without them says; ordinary families work."""
    families = {"AF_VSOCK": 40, "AF_ALG": 38, "AF_DECnet": 12, "past AF_MCTP": 46, "negative": -1}
    socket_of = lambda af: f"call(41, {af}, 1, 0)"  # socket(af, SOCK_STREAM, 0)  # noqa: E731
    pair_of = lambda af: f"call(53, {af}, 1, 0, id(bytearray(8)))"  # socketpair  # noqa: E731
    got = probe(ws, *(socket_of(af) for af in families.values()), *(pair_of(af) for af in families.values()),
                "call(41, 40, 1 | 0x80000, 0)", "call(41, 40 | 0x100000000, 1, 0)")
    for name, af in families.items():
        assert got[socket_of(af)] == errno.EAFNOSUPPORT, (name, got)
        assert got[pair_of(af)] == errno.EAFNOSUPPORT, (name, got)
    assert got["call(41, 40, 1 | 0x80000, 0)"] == errno.EAFNOSUPPORT  # SOCK_CLOEXEC changes nothing
    assert got["call(41, 40 | 0x100000000, 1, 0)"] == errno.EAFNOSUPPORT  # the kernel reads an int
    r = ws.exec(["python3", "-c", "import socket\n"
                 "for af, kind in ((socket.AF_UNIX, 1), (socket.AF_INET, 1), (socket.AF_INET6, 2), (socket.AF_NETLINK, 3)):\n"
                 "    socket.socket(af, kind).close()\n"
                 "a, b = socket.socketpair(); a.close(); b.close()\n"
                 "try:\n    socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n"
                 "except OSError as e:\n    print(e.strerror)\n"])
    assert (r.exit_code, r.stdout) == (0, "Address family not supported by protocol\n"), r.stderr


def test_proc_and_sys_are_masked_and_read_only(ws):
    got = probe(ws, "opened('/proc/kcore')", "opened('/proc/keys')", "opened('/proc/timer_list')",
                "opened('/proc/sysrq-trigger', 'wb')", "opened('/proc/sys/kernel/hostname', 'wb')",
                "opened('/sys/kernel/uevent_helper', 'wb')")
    for name in ("kcore", "keys", "timer_list"):  # masked where the host kernel has them
        assert got[f"opened('/proc/{name}')"] == ("" if os.path.exists(f"/proc/{name}") else errno.ENOENT)
    for path in ("/proc/sysrq-trigger", "/proc/sys/kernel/hostname", "/sys/kernel/uevent_helper"):
        refused = {errno.EROFS, errno.EACCES, errno.EPERM} | (set() if os.path.exists(path) else {errno.ENOENT})
        assert got[f"opened('{path}', 'wb')"] in refused, (path, got)
    assert ws.exec("ls -A /proc/acpi /sys/firmware 2>/dev/null").stdout.split() in ([], ["/proc/acpi:", "/sys/firmware:"])
    assert ws.exec("touch /sys/x").exit_code != 0
    assert ws.exec("cat /sys/devices/system/cpu/online").stdout.strip()  # programs that read /sys work
    assert ws.exec("ls /sys/class/net").stdout.split() == ["lo"]  # its own network namespace


def test_pid1_ignores_signals_sent_from_inside(ws):
    pid = ws.record.pid
    ws.exec("kill -TERM 1; kill -INT 1; kill -HUP 1; kill -USR1 1; kill -KILL 1; kill -STOP 1; true")
    ws.exec("pkill -f bunshin_agent; pkill python3; true")
    assert ws.exec("echo alive").stdout == "alive\n"
    assert container.is_alive(ws.record) and ws.record.pid == pid


def test_a_full_tmp_leaves_the_agent_working(ws):
    r = ws.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=1024 2>&1; df -k /tmp | tail -1", timeout=60)
    assert "No space left on device" in r.stdout
    assert ws.exec("echo alive").stdout == "alive\n"
    size = Path(ws.record.upper, "tmp", "fill").stat().st_size
    assert size <= container.upper_size(256 << 20)
    assert ws.exec("rm /tmp/fill && echo x > /tmp/y && cat /tmp/y").stdout == "x\n"


def test_a_forks_frozen_files_are_charged_to_the_workspace(no_leaks):
    from bunshin.errors import ResourceExhausted
    from bunshin.runtime.container.cgroups import WorkspaceCgroup

    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    clones = []
    try:
        assert ws.exec("head -c 40000000 /dev/urandom > /tmp/data").exit_code == 0
        rec = ws.record
        cg = WorkspaceCgroup.of_record(rec)
        before = cg.memory_bytes()
        clones += ws.fork(1)
        assert cg.memory_bytes() - before > 35_000_000  # the 40 MB copy went on its bill
        assert ws.exec("head -c 90000000 /dev/urandom > /tmp/more").exit_code == 0
        with pytest.raises(ResourceExhausted, match="charged to it"):
            ws.fork(1)  # a copy of 130 MB no longer fits: refused before anything is frozen
        assert ws.exec("echo alive").stdout == "alive\n"
    finally:
        for c in clones:
            c.remove()
        ws.remove()


@pytest.mark.parametrize("point", ["sys", "proc"])
def test_an_image_symlink_at_a_mount_point_is_not_followed(no_leaks, tmp_path, point):
    """The launcher mounts /sys as host root, pid 1 mounts /proc before its pivot (the
    host's tree still in view): a symlink an image brings there (pointing at a host
    folder) must not take that mount, or the mkdir of a mount point, elsewhere."""
    import shutil
    import subprocess

    from bunshin.errors import RuntimeFailure

    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("host data\n")
    root = tmp_path / "image"
    (root / "bin").mkdir(parents=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    subprocess.run(["cp", busybox, str(root / "bin" / "busybox")], check=True)
    (root / "bin" / "sh").symlink_to("busybox")
    (root / point).symlink_to(canary / "made-here")  # missing: a followed mkdir would make it
    with pytest.raises(RuntimeFailure, match=f"mount point /{point}"):
        Workspace.create(str(root), memory="256M", config=no_leaks)
    assert os.listdir(canary) == ["keep"] and (canary / "keep").read_text() == "host data\n"
    assert not any(canary in Path(line.split()[4]).parents or line.split()[4] == str(canary)
                   for line in open("/proc/self/mountinfo"))


# ---------------------------------------------------------------- helpers


def _tree(pid: int) -> list[int]:
    import psutil

    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def _ns_pid(host_pid: int) -> str:
    with open(f"/proc/{host_pid}/status") as f:
        return next(ln for ln in f if ln.startswith("NSpid:")).split()[-1]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _keyctl(op: int, *args: int) -> int:
    return _libc.syscall(ctypes.c_long(250), ctypes.c_long(op), *[ctypes.c_long(a) for a in args])


def _add_key(desc: str, payload: bytes) -> int:
    key = _libc.syscall(ctypes.c_long(248), b"user", desc.encode(), payload, ctypes.c_size_t(len(payload)),
                        ctypes.c_long(-3))  # KEY_SPEC_SESSION_KEYRING
    if key < 0:
        pytest.skip(f"cannot add a key on the host: {os.strerror(ctypes.get_errno())}")
    return key
