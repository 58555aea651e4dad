"""A clone's criu runs in a small mount namespace of its own (``snapshot.criu_mounts``,
``zygote``): the host keeps the clone's upper and root for its own work, nothing more."""

from __future__ import annotations

import pytest

from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.kernel import mountinfo

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_clones_restored_in_their_own_namespace_work_and_leave_the_host_two_mounts_each(family):
    ws = family.create()
    assert ws.exec(["sh", "-c", "echo parent > /root/file"]).exit_code == 0
    clones = family.fork(ws, 3)
    host = set(mountinfo.mount_points())
    for c in clones:
        wdir = family.cfg.paths.workspace(c.id)
        assert {str(wdir), str(wdir / "root")} <= host  # the host reaches its upper and root
        assert str(wdir / "sys") not in host  # its sysfs lived in criu's namespace, the clone holds its copy
        assert c.exec(["ls", "/sys/class/net"]).stdout.split() == ["lo"]
        assert c.files.read_text("/root/file") == "parent\n"
        c.files.write("/root/mine", c.id)
        assert (wdir / "upper" / "root" / "mine").read_text() == c.id  # file API and upper, host side
    assert ws.exec(["test", "-e", "/root/mine"]).exit_code == 1
    ids = [c.id for c in clones]
    for c in clones:
        c.remove()
        family.workspaces.remove(c)
    left = set(mountinfo.mount_points())
    assert not any(c in p for p in left for c in ids)  # teardown took both


def test_the_mounts_a_clones_criu_sees_are_its_own_parents_first(family):
    ws = family.create()
    snap = family.snapshot(ws)
    wdir = family.cfg.paths.workspace("ws-x")
    trees = rsnap.criu_mounts(family.cfg, snap.record, wdir)
    assert trees[0] == (str(family.cfg.tmpfs), False) and (str(wdir), True) in trees
    paths = [p for p, _ in trees]
    for i, p in enumerate(paths):  # each lies beneath one attached before it (or is the first)
        assert i == 0 or any(p.startswith(q + "/") for q in paths[:i])
    assert not any("/workspaces/" in p and p != str(wdir) for p in paths)  # no other clone's folder
