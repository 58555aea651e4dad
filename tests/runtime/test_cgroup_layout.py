"""``Layout.discover`` is read once per process and read again when what it was read from
changes: the process's own cgroups (``/proc/self/cgroup``), or the filesystem at a
hierarchy's mount point. On the host's real hierarchies, in a child process of its own
(a private mount namespace for the mount, a pids cgroup made for it and removed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from bunshin.runtime.container.cgroups import Layout

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from bunshin.runtime.container.cgroups import Layout
    from bunshin.runtime.kernel import syscalls as sc

    first = Layout.discover()
    assert Layout.discover() is first, "not kept"
    pids = next(h for h in first.hierarchies if "pids" in h.controllers)
    # the process moved to another cgroup: read again, the workspaces go beneath the new one
    Path(sys.argv[1], "cgroup.procs").write_text(str(os.getpid()))
    moved = Layout.discover()
    assert moved is not first
    assert next(h for h in moved.hierarchies if "pids" in h.controllers).base == Path(sys.argv[1])
    assert Layout.discover() is moved
    # another filesystem mounted over a hierarchy's mount point (a private mount namespace):
    # read again, and again once it is gone
    sc.unshare(sc.CLONE_NEWNS)
    sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
    sc.mount("tmpfs", str(pids.mountpoint), "tmpfs")
    over = Layout.discover()
    assert over is not moved
    sc.umount(str(pids.mountpoint))
    back = Layout.discover()
    assert back is not over and back == moved and Layout.discover() is back
    print("ok")
""")


@pytest.mark.integration
def test_discover_is_kept_until_the_process_moves_or_a_hierarchy_is_mounted_over(cfg):
    pids = next((h for h in Layout.discover().hierarchies if "pids" in h.controllers), None)
    if pids is None or Layout.discover().version != 1:
        pytest.skip("needs a cgroup v1 pids hierarchy")
    child = pids.base / f"{cfg.cgroup_prefix}layout-test"
    child.mkdir()
    try:
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(child)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    finally:
        child.rmdir()  # the child process exited: the cgroup is empty
