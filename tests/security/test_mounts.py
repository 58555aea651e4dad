"""Host folders shared on purpose (``--mount HOST:PATH[:ro|rw]``, issue 9).

Read-only: visible, not writable inside. Read-write: what the workspace writes is owned
on the host by the workspace's unprivileged id (never host root). A symlink the
workspace leaves in a shared folder changes nothing on the host. Clones share the same
folders. Bad mount strings and task specs fail with clear errors.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout import ModeOptions, Status, TraceReplayPolicy, parse_traces, rollout
from bunshin.rollout.task import parse_task
from bunshin.runtime.state.records import Mount, WorkspaceRecord, WorkspaceState
from bunshin.workspace import Workspace

from ..cli.test_cli import bunshin

pytestmark = pytest.mark.integration


@pytest.fixture
def folders(tmp_path):
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    (ro / "data.txt").write_text("shared data\n")
    rw.mkdir()
    rw.chmod(0o777)  # writable by the workspace's unprivileged host id
    return ro, rw


@pytest.fixture
def ws(no_leaks, folders):
    ro, rw = folders
    w = Workspace.create("host", memory="512M", pids=128, config=no_leaks,
                         mounts=[f"{ro}:/data", Mount(str(rw), "/work/out", read_only=False)])
    yield w
    w.remove()


def test_read_only_mount_is_visible_and_not_writable(ws, folders):
    ro, _ = folders
    assert ws.exec(["cat", "/data/data.txt"]).stdout == "shared data\n"
    for cmd in ("echo x > /data/new", "echo x >> /data/data.txt", "rm /data/data.txt", "mkdir /data/d",
                "mount -o remount,rw /data", "chmod 777 /data"):
        assert ws.exec(cmd).exit_code != 0, cmd
    assert sorted(os.listdir(ro)) == ["data.txt"] and (ro / "data.txt").read_text() == "shared data\n"
    assert ws.exec(["stat", "-c", "%u", "/data/data.txt"]).stdout.strip() == "0"  # idmapped: root's inside


def test_read_write_mount_writes_as_the_unprivileged_id(ws, folders):
    _, rw = folders
    r = ws.exec("echo hi > /work/out/f && mkdir /work/out/d && cp /bin/true /work/out/t && chmod 4755 /work/out/t")
    assert r.exit_code == 0, r
    assert (rw / "f").read_text() == "hi\n"
    base = ws.config.id_base
    for name in ("f", "d", "t"):
        st = os.lstat(rw / name)
        assert (st.st_uid, st.st_gid) == (base, base) and st.st_uid != 0, name
    (rw / "from-host").write_text("host\n")
    assert ws.exec(["cat", "/work/out/from-host"]).stdout == "host\n"
    assert ws.exec(["stat", "-c", "%U", "/work/out/from-host"]).stdout.strip() == "nobody"
    assert ws.exec("grep ' /work/out ' /proc/self/mountinfo").stdout.split()[5].split(",")[:3] == \
        ["rw", "nosuid", "nodev"]


def test_a_symlink_left_in_a_shared_folder_changes_nothing_on_the_host(ws, folders):
    _, rw = folders
    etc_before = sorted(os.listdir("/etc"))
    hostname = Path("/etc/hostname").read_bytes()
    r = ws.exec("ln -s /etc /work/out/etc && ln -s /etc/hostname /work/out/hn && "
                "echo pwned > /work/out/etc/bunshin-mount-test")  # resolved inside: the workspace's own /etc
    assert r.exit_code == 0 and ws.exec(["cat", "/etc/bunshin-mount-test"]).stdout == "pwned\n"
    clones = ws.fork(1)  # the host dumps and restores with the link in place
    try:
        assert clones[0].exec(["readlink", "/work/out/etc"]).stdout == "/etc\n"
    finally:
        for c in clones:
            c.remove()
    assert os.readlink(rw / "etc") == "/etc" and os.readlink(rw / "hn") == "/etc/hostname"
    assert sorted(os.listdir("/etc")) == etc_before and Path("/etc/hostname").read_bytes() == hostname
    assert not Path("/etc/bunshin-mount-test").exists()


def test_a_clone_shares_its_parents_folders(ws, folders):
    _, rw = folders
    ws.exec("echo parent > /work/out/p")
    clones = ws.fork(2)
    try:
        for i, c in enumerate(clones):
            assert c.record.mounts == ws.record.mounts
            assert c.exec(["cat", "/data/data.txt", "/work/out/p"]).stdout == "shared data\nparent\n"
            assert c.exec(f"echo {i} > /work/out/c{i}").exit_code == 0
            assert c.exec("touch /data/x").exit_code != 0
        assert [(rw / f"c{i}").read_text() for i in range(2)] == ["0\n", "1\n"]
        assert ws.exec(["cat", "/work/out/c1"]).stdout == "1\n"  # the same folder
    finally:
        for c in clones:
            c.remove()


def test_a_saved_snapshot_with_mounts_needs_trust(ws, tmp_path):
    from bunshin.workspace import Snapshot

    snap = ws.snapshot()
    try:
        folder = snap.save(tmp_path / "saved")
        with pytest.raises(InvalidArgument, match="shares host folders"):
            Snapshot.load(folder, config=ws.config)
    finally:
        snap.remove()


def test_records_keep_their_mounts():
    m = (Mount("/srv/a", "/a"), Mount("/srv/b", "/b", read_only=False))
    rec = WorkspaceRecord(id="ws-1", name=None, image="host", state=WorkspaceState.RUNNING, created_at=0.0, root="/r",
                          upper="/u", work="/w", lowers=(), cgroup_version=2, cgroups=(), memory_limit=None,
                          pids_limit=None, hostname="h", mounts=m)
    assert WorkspaceRecord.from_json(rec.to_json()).mounts == m


@pytest.mark.parametrize("text, message", [
    ("relative:/a", "not an absolute path"),
    ("/no/such/folder/anywhere:/a", "does not exist"),
    ("{tmp}:a", "not an absolute path"),
    ("{tmp}:/a/../b", "without '..'"),
    ("{tmp}:/a//b", "not normalised"),
    ("{tmp}:/a/", "not normalised"),
    ("{tmp}:/", "runtime makes"),
    ("{tmp}:/proc/x", "runtime makes"),
    ("{tmp}:/sys", "runtime makes"),
    ("{tmp}:/dev/shm", "runtime makes"),
    ("{tmp}:/.bunshin", "runtime makes"),
    ("{tmp}:/run", "runtime makes"),
    ("{tmp}:/a:rx", "HOST:PATH"),
    ("{tmp}", "HOST:PATH"),
    ("{file}:/a", "not a folder"),
])
def test_bad_mount_strings(tmp_path, text, message):
    (tmp_path / "f").write_text("")
    text = text.format(tmp=tmp_path, file=tmp_path / "f")
    with pytest.raises(InvalidArgument, match=message) as e:
        Mount.parse(text)
    assert e.value.hint


def test_bad_mounts_at_create(no_leaks, tmp_path):
    for mounts, message in (([f"{tmp_path}:/a", f"{tmp_path}:/a/b"], "overlap"),
                            ([f"{no_leaks.home}:/a"], "bunshin's own state"),
                            ([f"{no_leaks.home.parent}:/a"], "bunshin's own state")):
        with pytest.raises(InvalidArgument, match=message):
            Workspace.create("host", memory="256M", config=no_leaks, mounts=mounts)


def test_cli_mount(no_leaks, folders):
    ro, rw = folders
    r = bunshin(no_leaks, "create", "--memory", "256M", "--mount", "relative:/a", check=False)
    assert r.returncode != 0 and "not an absolute path" in r.stderr and "--mount HOST:PATH" in r.stderr
    ws_id = bunshin(no_leaks, "create", "--memory", "256M", "--mount", f"{ro}:/data",
                    "--mount", f"{rw}:/out:rw").stdout.strip()
    try:
        r = bunshin(no_leaks, "exec", ws_id, "--", "sh", "-c", "cat /data/data.txt; echo cli > /out/c")
        assert r.stdout == "shared data\n" and (rw / "c").read_text() == "cli\n"
    finally:
        bunshin(no_leaks, "rm", ws_id)


def test_task_mounts(no_leaks, folders, tmp_path):
    ro, rw = folders
    with pytest.raises(InvalidArgument, match="mounts") as e:
        parse_task({"id": "t", "mounts": ["/no/such/folder:/data"]})
    assert "does not exist" in str(e.value)
    with pytest.raises(InvalidArgument, match="mounts"):
        parse_task({"id": "t", "mounts": "/srv:/data"})
    (ro / "score").write_text("7\n")
    task = parse_task({"id": "mounted", "memory": "512M", "max_turns": 2, "call_timeout": 20,
                       "trajectory_timeout": 60, "reward": "cat /data/score",
                       "mounts": [str(ro) + ":/data", {"host": str(rw), "path": "/out", "read_only": False}]})
    assert task.mounts == (f"{ro}:/data:ro", f"{rw}:/out:rw")
    policy = TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "task": "mounted", "steps": [
        {"think_s": 0.0, "name": "bash", "arguments": {"command": f"cat /data/data.txt > /out/t{i}"}},
    ]}) for i in range(2)]))
    g = asyncio.run(rollout(task, policy, 2, mode="bunshin", options=ModeOptions(cache=False), config=no_leaks))
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * 2, [t.error for t in g.trajectories]
    assert g.rewards == [7.0, 7.0]
    assert sorted(p.name for p in rw.iterdir()) == ["t0", "t1"] and (rw / "t1").read_text() == "shared data\n"
