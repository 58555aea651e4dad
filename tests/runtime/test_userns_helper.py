"""``idmap.userns_fd``'s child (it shares its maker's memory and pauses until killed): a maker
killed before it killed the child (``kill -9`` of a forker) leaves an orphan holding the
dead maker's memory; gc finds it by its name and kills it, and leaves a live maker's alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bunshin.config import Config
from bunshin.runtime.container import idmap
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc

# a maker that dies (SIGKILL, as kill -9 mid-fork) before it kills its helper: the helper's
# kill is held back, so the maker dies with the helper still pausing
MAKER = """
import os, signal, sys
from bunshin.runtime.container import idmap
idmap.os.kill = lambda pid, sig: print(pid, flush=True)
idmap.os.waitpid = lambda pid, flags: (pid, 0)
idmap.userns_fd("0 100000 1")
sys.stdin.read()
"""


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def test_an_orphaned_helper_is_found_and_killed_by_gc(tmp_path) -> None:
    maker = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert maker.stdout is not None
    helper = int(maker.stdout.readline())
    try:
        assert _name(helper) == idmap.HELPER_NAME.decode()
        assert helper not in idmap.orphaned_helpers(), "a live maker's helper is not an orphan"
        assert _name(maker.pid) != idmap.HELPER_NAME.decode()  # the maker's thread got its own name back
        maker.kill()
        maker.wait()
        deadline = time.monotonic() + 10
        while helper not in idmap.orphaned_helpers():
            assert time.monotonic() < deadline, "the helper did not outlive its maker"
            time.sleep(0.05)
        cfg = Config.for_home(tmp_path / "home")
        with Store.open(cfg.db_path) as store:
            assert helper in gc.collect(cfg, store).processes
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{helper}") and _stat_state(helper) != "Z":
            assert time.monotonic() < deadline, "gc did not kill the orphaned helper"
            time.sleep(0.05)
    finally:
        if maker.poll() is None:
            maker.kill()
            maker.wait()
        if os.path.exists(f"/proc/{helper}") and _name(helper) == idmap.HELPER_NAME.decode():
            os.kill(helper, 9)


def _stat_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_workspace_process_that_takes_the_name_is_not_killed() -> None:
    """A process in another pid namespace (as every workspace process is) named like the
    helper and sharing no memory with its parent is not taken for an orphan: a workload
    cannot steer gc's kill by its name."""
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'bunshin-userns', 0, 0, 0); "
            "print(open('/proc/self/comm').read().strip(), flush=True); sys.stdin.read()")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == idmap.HELPER_NAME.decode()
        named = [int(c) for c in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()]
        assert named and _name(named[0]) == idmap.HELPER_NAME.decode()
        assert named[0] not in idmap.orphaned_helpers() and named[0] not in idmap.kill_orphaned_helpers()
        assert _stat_state(named[0]) not in ("Z", "gone")
    finally:
        p.kill()
        p.wait()
