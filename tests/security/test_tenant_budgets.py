"""Attacks on the kernel's per-user budgets: one workspace exhausts each, others keep working.

The kernel counts pipe buffers and keys per host uid, and inotify instances, message
queue bytes, pending signals and processes per user namespace *owner* at the host's
level. Each workspace and clone has a host id range and user namespace owner of its own
(``runtime.idranges``), so an attacker exhausting all of them in its workspace leaves the
other workspace's exec, fork, pipes, inotify, message queues, POSIX timers and keys
untouched, and host root's too. Run side by side (two fresh workspaces) and as a parent
whose clone attacks (a CRIU restore must give the clone its own owner and range). Keys cannot be spent from
inside (the seccomp filter refuses the keyring calls); the one a workspace's start takes
(its session keyring) is charged to its own root.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import time
from pathlib import Path

import pytest

from bunshin.runtime.criu import userns_owner
from bunshin.runtime.state import idranges
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]

F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
DEFAULT_PIPE = 65536
PIPE_SOFT = Path("/proc/sys/fs/pipe-user-pages-soft")

# The attacker: holds as much of each budget as the kernel lets it (bounded loops), says
# what stopped each loop, and keeps it all until it is killed.
HOG = r'''
import ctypes, errno, fcntl, json, os, resource, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
held, out = [], {}
name = lambda e: errno.errorcode.get(e, str(e))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

def pipes():
    for i in range(4096):  # 1 MiB each: the default soft budget (16384 pages) is 64 of them
        r, w = os.pipe()
        held.extend((r, w))
        try:
            fcntl.fcntl(w, 1031, 1 << 20)
        except OSError as e:
            r2, w2 = os.pipe()
            held.extend((r2, w2))
            return {"n": i, "stop": name(e.errno), "new_pipe": fcntl.fcntl(w2, 1032)}
    return {"n": 4096, "stop": None}

def inotify():
    for i in range(4096):
        fd = libc.inotify_init1(0)
        if fd < 0:
            return {"n": i, "stop": name(ctypes.get_errno())}
        held.append(fd)
    return {"n": 4096, "stop": None}

class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]

def mqueue():
    attr = MqAttr(0, 10, 8192, 0)
    for i in range(1000):
        fd = libc.syscall(240, f"hog-{i}".encode(), os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(attr))
        if fd < 0:
            return {"n": i, "stop": name(ctypes.get_errno())}
        held.append(fd)
    return {"n": 1000, "stop": None}

def sigpending():
    sig = signal.SIGRTMIN
    signal.pthread_sigmask(signal.SIG_BLOCK, [sig])
    for i in range(2_000_000):  # sigqueue: kill() of a queue that is full drops the signal silently
        if libc.sigqueue(os.getpid(), sig, ctypes.c_long(i)) < 0:
            return {"n": i, "stop": name(ctypes.get_errno())}
    return {"n": 2_000_000, "stop": None}

def keys():
    for i in range(5000):
        if libc.syscall(248, b"user", f"hog{i}".encode(), b"x" * 64, 64, -3) < 0:
            return {"n": i, "stop": name(ctypes.get_errno())}
    return {"n": 5000, "stop": None}

def processes():
    for i in range(8192):
        try:
            os.posix_spawn("/bin/sleep", ["sleep", "3600"], os.environ)
        except OSError as e:
            return {"n": i, "stop": name(e.errno)}
    return {"n": 8192, "stop": None}

for f in (pipes, inotify, mqueue, sigpending, keys, processes):
    out[f.__name__] = f()
with open("/tmp/hog.tmp", "w") as f:
    json.dump(out, f)
os.rename("/tmp/hog.tmp", "/tmp/hog.json")
while True:
    time.sleep(3600)
'''

# The victim's ordinary work: every call the attack would break if the budgets were shared.
WORK = r'''
import ctypes, errno, fcntl, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
r, w = os.pipe()
out["pipe_size"] = fcntl.fcntl(w, 1032)
fd = libc.inotify_init1(0)
out["inotify"] = 0 if fd >= 0 else errno.errorcode[ctypes.get_errno()]
class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
q = libc.syscall(240, b"work", os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(MqAttr(0, 10, 8192, 0)))  # as big as the hog's
out["mqueue"] = 0 if q >= 0 else errno.errorcode[ctypes.get_errno()]
libc.syscall(241, b"work")
timer = ctypes.c_long()
t = libc.syscall(222, 1, None, ctypes.byref(timer))  # timer_create(CLOCK_MONOTONIC): a preallocated signal
out["timer"] = 0 if t == 0 else errno.errorcode[ctypes.get_errno()]
pid = os.fork()
if pid == 0:
    os._exit(7)
out["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(out))
'''
WORKED = {"pipe_size": DEFAULT_PIPE, "inotify": 0, "mqueue": 0, "timer": 0, "fork": 7}


def _attack(attacker: Workspace) -> dict:
    attacker.files.write("/tmp/hog.py", HOG)
    assert attacker.exec("nohup python3 /tmp/hog.py >/tmp/hog.out 2>&1 &").exit_code == 0
    result = Path(attacker.record.upper) / "tmp" / "hog.json"
    deadline = time.monotonic() + 120
    while not result.exists():
        assert time.monotonic() < deadline, (Path(attacker.record.upper) / "tmp" / "hog.out").read_text()
        time.sleep(0.2)
    return json.loads(result.read_text())


def _check_exhausted(held: dict) -> None:
    """The attack really reached each limit (else the test would prove nothing)."""
    if int(PIPE_SOFT.read_text()) > 0:
        assert held["pipes"]["stop"] == "EPERM" and held["pipes"]["new_pipe"] < DEFAULT_PIPE, held["pipes"]
    assert held["inotify"]["stop"] == "EMFILE", held["inotify"]
    assert held["mqueue"]["stop"] == "EMFILE", held["mqueue"]
    assert held["sigpending"]["stop"] == "EAGAIN", held["sigpending"]
    assert held["keys"] == {"n": 0, "stop": "EPERM"}, held["keys"]  # the seccomp filter refuses the keyring
    assert held["processes"]["stop"] == "EAGAIN", held["processes"]


def _works(ws: Workspace) -> None:
    ws.files.write("/tmp/work.py", WORK)
    r = ws.exec(["python3", "/tmp/work.py"], timeout=60)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == WORKED


def _keys_of(uid: int) -> int:
    """Keys the host user ``uid`` holds against its quota (``/proc/key-users``: ``qnkeys/maxkeys``)."""
    for line in Path("/proc/key-users").read_text().splitlines():
        who, _, rest = line.partition(":")
        if int(who) == uid:
            return int(rest.split()[2].split("/")[0])
    return 0


def _host_root_works() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, errno.errorcode[ctypes.get_errno()]
    os.close(fd)
    r, w = os.pipe()
    try:
        assert fcntl.fcntl(w, F_GETPIPE_SZ) == DEFAULT_PIPE
    finally:
        os.close(r)
        os.close(w)
    libc.syscall.restype = ctypes.c_long
    timer = ctypes.c_long()
    assert libc.syscall(222, 1, None, ctypes.byref(timer)) == 0, errno.errorcode[ctypes.get_errno()]
    libc.syscall(226, timer)  # timer_delete


@pytest.mark.parametrize("pair", ["side_by_side", "parent_and_clone"])
def test_one_workspace_exhausting_every_budget_leaves_the_others_working(no_leaks, pair):
    victim = Workspace.create("host", memory="512M", pids=128, config=no_leaks)
    made = [victim]
    try:
        if pair == "side_by_side":
            made.append(Workspace.create("host", memory="512M", pids=128, config=no_leaks))
        else:
            made += victim.fork(1)
        attacker = made[-1]
        ids = {w.id: w.record.ids for w in made}
        assert len(set(ids.values())) == len(made) and None not in ids.values(), ids
        for w in made:  # each user namespace is owned by its own root, never host root
            assert userns_owner.owner_of(w.record.pid) == w.record.ids
        _check_exhausted(_attack(attacker))
        _works(victim)
        clone = victim.fork(1)[0]  # CRIU restores the victim's pipes and keyring: its budgets
        made.append(clone)
        _works(clone)
        made.append(Workspace.create("host", memory="256M", pids=64, config=no_leaks))
        _works(made[-1])
        # a workspace's session keyring is its own root's key, never one of a uid all share
        assert _keys_of(made[-1].record.ids) == 1
        _host_root_works()
    finally:
        for w in reversed(made):
            w.remove()


def test_a_clone_whose_namespace_host_root_would_own_is_refused(no_leaks, tmp_path):
    """criu run without bunshin's helper (a wrapper that drops LD_PRELOAD) makes the clone's
    user namespace as host root: the restore is refused by name, nothing of it is left."""
    import dataclasses

    from bunshin.errors import RuntimeFailure
    from bunshin.runtime.state.store import Store

    parent = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        wrapper = tmp_path / "criu"
        wrapper.write_text(f"#!/bin/sh\nunset LD_PRELOAD\nexec {no_leaks.criu} \"$@\"\n")
        wrapper.chmod(0o755)
        broken = Workspace.get(parent.id, config=dataclasses.replace(no_leaks, criu=wrapper))
        with pytest.raises(RuntimeFailure, match="owned by host uid 0, not its own root") as info:
            broken.fork(1)
        assert "userns_owner" in (info.value.hint or "")
        assert [w.id for w in Workspace.list(config=no_leaks)] == [parent.id]
        with Store.open(no_leaks.db_path) as store:
            assert set(idranges.held(no_leaks, store).values()) == {parent.id}
        _works(parent)
    finally:
        parent.remove()
