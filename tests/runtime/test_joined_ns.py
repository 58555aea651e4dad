"""A fork's dump with criu in the tree's UTS and IPC namespaces: what ``joined_ns`` reads is
what CRIU's own dumpers write, the clone gets both namespaces back (its own, with the
parent's names and sysctls), and a tree holding SysV objects is dumped by CRIU's dumper."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from bunshin.runtime.criu import joined_ns
from bunshin.runtime.memfile import criu_images
from bunshin.runtime.snapshot import upper_copy

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _ns(ws, kind: str) -> str:
    return os.readlink(f"/proc/{ws.record.pid}/ns/{kind}")


def _attempts(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    start_over = upper_copy.start_over

    def counted(images: Path, layer: Path) -> None:
        seen.append(True)
        start_over(images, layer)

    monkeypatch.setattr(upper_copy, "start_over", counted)
    return seen


def _traced(family) -> None:
    family.cfg = dataclasses.replace(family.cfg, dump_log_level=4)  # the dumpers' lines in the log


def test_what_is_read_is_what_criu_writes(family, monkeypatch):
    """The reader against CRIU's own dumpers (the joined dump refused once: the second is
    made with criu in its own namespaces), on one tree."""
    _traced(family)
    attempts = _attempts(monkeypatch)
    ws = family.create()
    reader = joined_ns.Reader(ws.record.pid)
    try:
        seen = reader.result()
    finally:
        reader.close()
    refused: list[bool] = []

    def once(self) -> None:
        if not refused:
            refused.append(True)
            raise joined_ns.HasSysvObjects("refused once by the test")

    monkeypatch.setattr(joined_ns.Reader, "check", once)
    snap = family.snapshot(ws)
    assert attempts == [True]
    images = Path(snap.record.images)
    assert "Dump UTS namespace" in (images / "dump.log").read_text(errors="replace")  # CRIU's dumper wrote these
    uts, ipc = joined_ns.tree_ids(images)
    assert criu_images.load(images / f"utsns-{uts}.img")["entries"] == [
        {"nodename": seen.nodename, "domainname": seen.domainname}]
    assert criu_images.load(images / f"ipcns-var-{ipc}.img")["entries"] == [seen.ipc_var]
    assert seen.nodename == ws.record.hostname and seen.sysv_objects == 0
    before = {f.name: f.read_bytes() for f in images.iterdir() if f.is_file()}
    joined_ns.add(images, seen)  # a dump CRIU wrote them in is left as it is
    assert {f.name: f.read_bytes() for f in images.iterdir() if f.is_file()} == before


def test_a_joined_dump_runs_no_dumper_and_the_clone_gets_its_own_namespaces(family, monkeypatch):
    _traced(family)
    attempts = _attempts(monkeypatch)
    ws = family.create()
    snap = family.snapshot(ws)
    assert attempts == []
    images = Path(snap.record.images)
    log = (images / "dump.log").read_text(errors="replace")
    assert "Dumping pstree" in log  # a -v4 log, in which CRIU names each dumper it forks
    assert "Dump UTS namespace" not in log and "Dump IPC namespace" not in log
    root = criu_images.load(images / "inventory.img")["entries"][0]["root_ids"]
    uts, ipc = joined_ns.tree_ids(images)
    assert (root["uts_ns_id"], root["ipc_ns_id"]) != (uts, ipc)  # restored as the tree's own
    (clone,) = family.restore(snap, 1)
    for kind in ("uts", "ipc"):
        assert _ns(clone, kind) not in (_ns(ws, kind), os.readlink(f"/proc/self/ns/{kind}"))
    assert clone.exec(["hostname"]).stdout.strip() == ws.exec(["hostname"]).stdout.strip() == ws.record.hostname
    want = ws.exec(["cat", "/proc/sys/kernel/sem", "/proc/sys/fs/mqueue/msg_max"]).stdout
    assert clone.exec(["cat", "/proc/sys/kernel/sem", "/proc/sys/fs/mqueue/msg_max"]).stdout == want
    (grand,) = family.fork(clone, 1)  # and a fork of it, joined again
    assert grand.exec(["hostname"]).stdout.strip() == ws.record.hostname
    assert _ns(grand, "uts") != _ns(clone, "uts")


def test_sysv_objects_are_counted_in_the_trees_namespace_and_dumped_by_criu(family, monkeypatch):
    _traced(family)
    attempts = _attempts(monkeypatch)
    ws = family.create()
    assert joined_ns.sysv_objects(ws.record.pid) == 0
    r = ws.exec(["sh", "-c", "ipcmk -M 8192 >/dev/null && ipcmk -Q >/dev/null && ipcs -m -q | grep -c 0x"])
    assert r.exit_code == 0 and r.stdout.strip() == "2", r
    assert joined_ns.sysv_objects(ws.record.pid) == 2  # the tree's, not this process's namespace
    snap = family.snapshot(ws)
    assert attempts == [], "seen before the dump: one dump, by CRIU's own IPC dumper"
    log = (Path(snap.record.images) / "dump.log").read_text(errors="replace")
    assert "Dump IPC namespace" in log
    (clone,) = family.restore(snap, 1)
    assert clone.exec(["sh", "-c", "ipcs -m -q | grep -c 0x"]).stdout.strip() == "2"


#: a process that makes a SysV shared-memory segment, maps it and waits (as an X client using MIT-SHM)
_SHM_MAPPER = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
sid = libc.shmget(0, 8192, 0o1600)
assert sid >= 0 and libc.shmat(sid, None, 0) not in (None, ctypes.c_void_p(-1).value)
ctypes.memmove(libc.shmat(sid, None, 0), b"mapped", 6)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_segment_mapped_after_the_look_is_dumped_again_by_criu(family, monkeypatch):
    """A segment made between the look before the dump and the freeze: CRIU refuses its mapping
    in a namespace it does not dump, and the fork is made again with CRIU's dumper."""
    _traced(family)
    attempts = _attempts(monkeypatch)
    monkeypatch.setattr(joined_ns, "sysv_objects", lambda pid: 0)  # the look saw none
    ws = family.create()
    ws.files.write("/tmp/shm.py", _SHM_MAPPER.encode())
    ws.commands.spawn(["sh", "-c", "exec python3 /tmp/shm.py > /tmp/shm.out"])
    deadline = time.monotonic() + 20
    while ws.exec(["cat", "/tmp/shm.out"]).stdout.strip() != "ready":
        assert time.monotonic() < deadline, ws.exec(["cat", "/tmp/shm.out"])
        time.sleep(0.1)
    snap = family.snapshot(ws)
    assert attempts == [True], "the joined dump failed on the mapping and was made again"
    assert "Dump IPC namespace" in (Path(snap.record.images) / "dump.log").read_text(errors="replace")
    (clone,) = family.restore(snap, 1)
    assert clone.exec(["sh", "-c", "ipcs -m | grep -c 0x"]).stdout.strip() == "1"


def test_the_reader_joins_before_the_freeze_and_reads_only_when_told(family):
    ws = family.create()
    reader = joined_ns.Reader(ws.record.pid)
    try:
        handlers = reader.notify({})  # composed before the dump: the thread is made and joins the namespaces
        assert reader._thread is not None and "pre-dump" not in handlers  # nothing starts just before the freeze
        tid = reader._thread.native_id
        deadline = time.monotonic() + 10
        while (os.readlink(f"/proc/self/task/{tid}/ns/ipc") != _ns(ws, "ipc")  # joined uts, then ipc
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert [os.readlink(f"/proc/self/task/{tid}/ns/{k}") for k in ("uts", "ipc")] == [
            _ns(ws, "uts"), _ns(ws, "ipc")]
        time.sleep(0.05)
        assert reader._seen is None  # nothing read before query-ext-files
        assert reader.result().nodename == ws.record.hostname
    finally:
        reader.close()
    assert os.readlink("/proc/self/ns/uts") != _ns(ws, "uts")  # the rest of this process never joined
