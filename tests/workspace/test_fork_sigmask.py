"""Integration: the trap that keeps converted memory exact is invisible to what a program blocks (issue 30).

``progs/sigmask.c``: its main thread blocks every signal but SIGTERM with SIGUSR1
pending, a worker thread blocks every signal and makes the trapped calls (madvise
DONTNEED, mremap shrink and regrow) on memory written before the fork, and a POSIX
SIGEV_THREAD timer runs (glibc's helper thread blocks every signal). Such a process
keeps its memory anonymous (a trap while SIGSYS is blocked kills it, unblocking SIGSYS
would show): every clone and a fork of a fork read back the parent's masks and pending
set, the timer goes on and the calls read zeros. With ``LATE`` it blocks nothing before
the fork: converted, it reads back every mask it sets after the fork (``sigprocmask``,
``pthread_sigmask``, ``sigpending``, an action's mask, a fork() child's and an exec'd
program's), and its threads blocking every signal trap (not killed).
Both with and without the live pre-copy (which gives the trap to the running parent).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.workspace import Session, Workspace
from tests.workspace.test_fork import wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"
DIR = "/tmp/sm"


@pytest.fixture(scope="module")
def sigmask(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("sigmask") / "sigmask"
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(out), str(PROGS / "sigmask.c")], check=True)
    return out.read_bytes()


def start(ws: Workspace, binary: bytes, *env: str) -> int:
    ws.files.write("/root/sigmask", binary, mode=0o755)
    assert ws.exec(["mkdir", "-p", DIR]).exit_code == 0
    ws.commands.spawn(["env", *env, "/root/sigmask", DIR])
    return int(wait_file(ws, f"{DIR}/ready"))


def ask(ws: Workspace, req: str) -> str:
    script = (f'rm -f {DIR}/out; printf "%s\\n" "$1" > {DIR}/req.tmp && mv {DIR}/req.tmp {DIR}/req;'
              f' while [ ! -e {DIR}/out ]; do sleep 0.01; done; cat {DIR}/out')
    r = ws.exec(["sh", "-c", script, "sh", req], timeout=20)
    assert r.exit_code == 0 and not r.timed_out, f"{ws.id}: no answer to {req!r}: {r}"
    return r.stdout.strip()


def steady(masks: str) -> str:
    """``masks`` without the timer's own signal (32, glibc's SIGTIMER) pending in a thread, nor glibc's
    own signals (32, 33) blocked in one: they are, for a moment, each time the timer fires (its helper
    thread blocks them too while it starts the thread that runs the function)."""
    masks = re.sub(r"SigPnd:\t(\w+)", lambda m: f"SigPnd:\t{int(m[1], 16) & ~(1 << 31):016x}", masks)
    return re.sub(r"SigBlk:\t(\w+)", lambda m: f"SigBlk:\t{int(m[1], 16) & ~(3 << 31):016x}", masks)


def maps_memfile(ws: Workspace, pid: int) -> bool:
    return ".bunshin-mem" in ws.exec(["cat", f"/proc/{pid}/maps"]).stdout


def live(family, on: bool) -> None:
    family.cfg = dataclasses.replace(family.cfg, fork_precopy=on, fork_precopy_min_mib=0)


@pytest.mark.parametrize("precopy", [False, True], ids=["dump", "precopy"])
def test_masks_pending_timer_and_trapped_calls_of_threads_blocking_everything(family, sigmask, precopy):
    live(family, precopy)
    ws = family.create()
    pid = start(ws, sigmask)
    masks = steady(ask(ws, "masks"))
    assert re.search(r"mask (\w+) pending 200\b", masks), masks  # SIGUSR1 (10) pending
    sigsys = 1 << 30
    assert int(masks.split()[1], 16) & sigsys  # blocked (all but SIGTERM)
    clones = family.fork(ws, 2)
    clones += family.fork(clones[0], 1)  # and a fork of a fork
    time.sleep(0.3)
    for w in [ws, *clones]:
        assert steady(ask(w, "masks")) == masks, w.id  # the mask, pending set and each thread's SigBlk/SigPnd/ShdPnd
        ticks = int(ask(w, "ticks"))
        time.sleep(0.1)
        assert int(ask(w, "ticks")) > ticks, f"{w.id}: the timer stopped"
        assert ask(w, "dontneed") == f"zero zero worker {int(masks.split()[1], 16) | 1 << 14:x}", w.id
        assert steady(ask(w, "masks")) == masks, w.id
    assert not any(maps_memfile(c, pid) for c in clones)  # left anonymous


FULL = 0xFFFFFFFE7FFBFEFF  # every signal but SIGKILL, SIGSTOP and glibc's own (32, 33)
LATE = {  # what the program reads after the fork, converted or not (the kernel's answers)
    "dontneed": f"zero zero worker {FULL:x}",  # the worker blocked everything, SIGSYS too, and trapped
    "held": "held ran 0 pending 1 after 1",  # a raised SIGSYS it blocks waits, shows, then runs once
    "forkmask": f"child {FULL:x} SigBlk:\t{FULL:016x} status 0",  # a fork() child and what it execs
    "timer": "timer ok 1 bad 0",  # glibc's SIGEV_THREAD thread drops pre-fork memory
    "errors": f"errors 22 14 14 14 blocked {1 << 30:x}",  # EINVAL, EFAULT (a bad old set: after blocking)
    "churn": f"churn {FULL:x}",  # after 1,000 threads exited blocking SIGSYS (their slots are reused)
}


def view(masks: str) -> str:
    """What the program reads back itself (sigprocmask, sigpending, an action's mask), not /proc."""
    return masks.split(" SigPnd")[0]


@pytest.mark.parametrize("precopy", [False, True], ids=["dump", "precopy"])
def test_a_thread_of_a_converted_process_blocking_everything_after_the_fork_is_trapped_not_killed(
        family, sigmask, precopy):
    """Converted (the trap keeps its memory exact), the program blocks what it likes after the fork:
    it reads back the masks and pending set it set (SIGSYS too), a SIGSYS it blocks waits, a fork()
    child and what that execs inherit the mask, and the trapped calls of its threads blocking
    everything (its worker, glibc's timer thread) act, in the parent, every clone and a fork of a fork."""
    live(family, precopy)
    ws = family.create()
    pid = start(ws, sigmask, "LATE=1")
    before = view(ask(ws, "masks"))
    (c,) = family.fork(ws, 1)
    (cc,) = family.fork(c, 1)
    usr2 = f"usr2 {1 << 30 | 1 << 0:x}"  # SIGSYS and SIGHUP, as given before the fork
    assert usr2 in before
    for w in (ws, c, cc):
        assert maps_memfile(w, pid) is (w is not ws or precopy), w.id  # the live pre-copy converts the parent
        assert view(ask(w, "masks")) == before, w.id
        assert ask(w, "setaction") == f"urg {1 << 30 | 1 << 9:x}", w.id  # SIGSYS and SIGUSR1, read back
        for req, want in LATE.items():
            assert ask(w, req) == want, f"{w.id}: {req}"
        assert view(ask(w, "masks")) == before, w.id
        worker = re.findall(r"SigBlk:\t(\w+)", ask(w, "masks"))
        # /proc/PID/status is the kernel's: a converted thread blocking SIGSYS lacks that bit there only
        assert f"{FULL & ~(1 << 30) if maps_memfile(w, pid) else FULL:016x}" in worker, (w.id, worker)
        assert w.exec(["kill", "-0", str(pid)]).exit_code == 0


def test_a_bash_session_whose_handlers_mask_sigsys_is_still_shared(family):
    """bash's handlers of terminating signals block them all, SIGSYS too: that mask only loses
    SIGSYS, the shell stays converted (shared) and its session goes on in the clone."""
    ws = family.create()
    sh = ws.shell()
    sh.run("words=$(seq 1 20000 | tr '\\n' ' ')")
    pid = int(ws.exec(["pgrep", "-x", "bash"]).stdout.split()[0])
    (c,) = family.fork(ws, 1)
    assert maps_memfile(c, pid)
    assert Session(c, sh.id).run("echo ${#words}").output.strip() == sh.run("echo ${#words}").output.strip()
