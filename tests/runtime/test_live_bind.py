"""``memfile.live_bind``: a live file bound into a real workspace's mount namespace, and what its removal
does when it cannot remove anything (nothing bound there, the process gone, a path that is not the host's)."""

from __future__ import annotations

import os
import secrets
import select
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from bunshin.runtime.memfile import SUFFIX, live_bind
from bunshin.runtime.snapshot import MEM_VIEW, precopy
from bunshin.workspace import Workspace

from .test_inject import host_pid

VIEW = MEM_VIEW
CANARY = "live-bind canary " * 64


@dataclass
class Bindable:
    ws: Workspace
    name: str
    host_dir: int  # paths.mem, where the file lies
    mem_dir: int  # the upper's host-owned /.bunshin/mem, where its placeholder lies
    pidfd: int  # the workspace's init

    def inside(self) -> str:
        """What the workspace reads at the file's path."""
        r = self.ws.exec(["cat", f"{VIEW}/{self.name}"])
        assert r.exit_code == 0, r
        return r.stdout


def _host_mounts(b: Bindable) -> list[str]:
    """The host's mounts of the workspace and of the file (the machine is shared: others' come and go)."""
    return [ln for ln in Path("/proc/self/mountinfo").read_text().splitlines() if b.ws.id in ln or b.name in ln]


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def bindable(family) -> Iterator[Bindable]:
    cfg = family.cfg
    ws = family.create()
    cfg.paths.mem.mkdir(parents=True, exist_ok=True)
    name = f"{precopy.PREFIX}{ws.id}-{secrets.token_hex(4)}{SUFFIX}"
    (cfg.paths.mem / name).write_text(CANARY)
    mem = precopy._mem_dir(Path(ws.record.upper))
    precopy._placeholder(mem, name)
    host = os.open(cfg.paths.mem, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    pidfd = os.pidfd_open(ws.record.pid)
    try:
        yield Bindable(ws, name, host, mem, pidfd)
    finally:
        for fd in (pidfd, host, mem):
            os.close(fd)
        (cfg.paths.mem / name).unlink(missing_ok=True)


def test_unbind_removes_the_bind_and_a_second_bind_is_refused(bindable: Bindable) -> None:
    b = bindable
    host_before = _host_mounts(b)
    live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)
    assert precopy.bound_views(b.ws.record.pid, VIEW) == [f"{VIEW}/{b.name}"]
    assert b.inside() == CANARY
    # bound, the placeholder holds bytes as seen inside: no second bind stacks on it
    with pytest.raises(live_bind.BindFailed, match="not the host's placeholder"):
        live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)
    live_bind.unbind(b.pidfd, VIEW, b.name)
    assert precopy.bound_views(b.ws.record.pid, VIEW) == []
    assert b.inside() == ""  # the host's empty placeholder again
    assert _host_mounts(b) == host_before  # nothing ever reached the host's mount table


def test_unbind_where_nothing_is_bound_is_a_clear_error_that_changes_nothing(bindable: Bindable) -> None:
    b = bindable
    live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)
    live_bind.unbind(b.pidfd, VIEW, b.name)
    ns_before = Path(f"/proc/{b.ws.record.pid}/mountinfo").read_text()
    host_before, kids, fds = _host_mounts(b), _children(), _fds()
    with pytest.raises(live_bind.BindFailed, match=rf"cannot unbind the live file at {VIEW}/{b.name}: nothing is bound"):
        live_bind.unbind(b.pidfd, VIEW, b.name)
    with pytest.raises(live_bind.BindFailed, match="cannot unbind .*No such file"):
        live_bind.unbind(b.pidfd, VIEW, "live-missing" + SUFFIX)
    assert Path(f"/proc/{b.ws.record.pid}/mountinfo").read_text() == ns_before
    assert (_host_mounts(b), _children(), _fds()) == (host_before, kids, fds)  # no mount, helper or descriptor left
    st = os.stat(b.name, dir_fd=b.mem_dir, follow_symlinks=False)
    assert (st.st_uid, st.st_size) == (0, 0)  # the placeholder is still the host's, empty
    live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)  # and takes a bind again
    assert b.inside() == CANARY


def test_unbind_refuses_a_folder_of_the_workspace_or_a_planted_symlink(bindable: Bindable) -> None:
    """The workspace cannot make the host unmount for it: a path through its own folders is refused
    before any unmount, and the real bind stays."""
    b = bindable
    live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)
    plant = f"mkdir -p /tmp/w && : > /tmp/w/{b.name} && ln -s {VIEW} /tmp/l && ln -s /.bunshin /tmp/b"
    assert b.ws.exec(["sh", "-c", plant]).exit_code == 0
    ns_before = Path(f"/proc/{b.ws.record.pid}/mountinfo").read_text()
    for view, why in [("/tmp/w", "not the host's"), ("/tmp/l", "Not a directory|Too many levels"),
                      ("/tmp/b/mem", "Not a directory|Too many levels")]:
        with pytest.raises(live_bind.BindFailed, match=why):
            live_bind.unbind(b.pidfd, view, b.name)
    assert Path(f"/proc/{b.ws.record.pid}/mountinfo").read_text() == ns_before
    assert b.inside() == CANARY
    live_bind.unbind(b.pidfd, VIEW, b.name)


def test_unbind_through_a_process_that_is_gone_is_refused_and_the_namespace_keeps_its_bind(bindable: Bindable) -> None:
    """The pidfd names the process the file was made for; gone, its namespace (the workspace's, which
    its other processes still hold) cannot be entered through it: a clear error, nothing done, and
    the bind is removed through any other process of the workspace."""
    b = bindable
    inner = b.ws.commands.spawn(["sleep", "600"])
    pid = host_pid(b.ws, inner)
    gone = os.pidfd_open(pid)
    try:
        live_bind.bind(b.host_dir, b.name, gone, VIEW)
        os.kill(pid, 9)
        assert select.select([gone], [], [], 10)[0], "the sleeper did not end"  # a pidfd reads once it exits
        host_before, kids, fds = _host_mounts(b), _children(), _fds()
        for call in (lambda: live_bind.unbind(gone, VIEW, b.name), lambda: live_bind.bind(b.host_dir, b.name, gone, VIEW)):
            with pytest.raises(live_bind.BindFailed, match="No such process"):
                call()
        assert (_host_mounts(b), _children(), _fds()) == (host_before, kids, fds)
        assert precopy.bound_views(b.ws.record.pid, VIEW) == [f"{VIEW}/{b.name}"]  # still the workspace's
        live_bind.unbind(b.pidfd, VIEW, b.name)  # its init is in the same namespace
        assert precopy.bound_views(b.ws.record.pid, VIEW) == []
    finally:
        os.close(gone)


def test_a_removed_workspace_leaves_no_bind_and_no_file(bindable: Bindable) -> None:
    """The workspace removed with the file bound: unbind is refused (no namespace to enter), the host's
    mount table never held the bind, and the file went with the workspace (nothing else links it)."""
    b = bindable
    host_before = _host_mounts(b)
    live_bind.bind(b.host_dir, b.name, b.pidfd, VIEW)
    assert not [ln for ln in host_before if b.name in ln]
    b.ws.remove()
    with pytest.raises(live_bind.BindFailed, match="No such process"):
        live_bind.unbind(b.pidfd, VIEW, b.name)
    assert _host_mounts(b) == []  # its mounts gone with it, and the bind was never the host's
    assert not os.path.exists(f"/proc/self/fd/{b.host_dir}/{b.name}")  # its live file swept with it
