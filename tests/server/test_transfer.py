"""Snapshots between hosts over HTTP: save as a tar stream, load from one; hostile archives refused."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import httpx
import pytest

from bunshin.errors import InvalidArgument, SnapshotNotFound

from .conftest import Served

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def _snapshot_with_state(c):
    ws = c.create(memory="256M")
    ws.exec("echo carried > /tmp/state; sleep 600 &", timeout=30)
    snap = ws.snapshot()
    ws.remove()
    return snap


def _no_scratch_left(served: Served, home: Path) -> None:
    left = list((home / "transfers").iterdir()) if (home / "transfers").exists() else []
    assert left == [], left


def test_save_and_load_round_trip_over_http(served, no_leaks, tmp_path):
    with served.client() as c:
        snap = _snapshot_with_state(c)
        folder = snap.save(tmp_path / "saved")
        assert (folder / "snapshot.json").is_file() and any((folder / "images").iterdir())
        snap.remove()
        assert c.snapshots() == []
        back = c.load_snapshot(folder)  # a new snapshot on the host, from the folder alone
        assert [s.id for s in c.snapshots()] == [back.id]
        (ws,) = back.restore(1)
        assert ws.exec("cat /tmp/state", timeout=30).stdout == "carried\n"
        assert "sleep 600" in ws.exec("ps -eo args", timeout=30).stdout  # the processes came too
        ws.remove()
        back.remove()
    _no_scratch_left(served, no_leaks.home)


def test_saving_into_a_folder_that_is_not_empty_is_refused(served, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine").write_text("keep")
    with served.client() as c:
        snap = _snapshot_with_state(c)
        with pytest.raises(InvalidArgument, match="not an empty folder"):
            snap.save(tmp_path / "full")
        assert (tmp_path / "full" / "mine").read_text() == "keep"
        snap.remove()
        with pytest.raises(SnapshotNotFound):
            snap.save(tmp_path / "new")
        assert not (tmp_path / "new").exists()


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _post(served: Served, body: bytes) -> httpx.Response:
    return httpx.post(f"{served.url}/v1/snapshots/load", content=body, timeout=60,
                      headers={"Authorization": f"Bearer {served.token}", "Content-Type": "application/x-tar"})


def test_hostile_archives_are_refused_and_leave_nothing(served, no_leaks, tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    link = tarfile.TarInfo("images/link")
    link.type, link.linkname = tarfile.SYMTYPE, str(canary)
    dev = tarfile.TarInfo("images/null")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    hostile = {
        "garbage": b"this is not a tar" * 100,
        "truncated": _tar([_file("snapshot.json", b"{}" * 600)])[:700],
        "dot-dot": _tar([_file(f"../../../../../../{canary}", b"owned")]),
        "absolute": _tar([_file(str(canary), b"owned")]),
        "symlink out": _tar([(link, None), _file("images/link", b"owned")]),
        "device node": _tar([(dev, None)]),
        "forged manifest": _tar([_file("snapshot.json", json.dumps({"format": 1, "mac": "00" * 32}).encode())]),
        "empty": b"",
    }
    for what, body in hostile.items():
        r = _post(served, body)
        assert r.status_code in (400, 422), (what, r.status_code, r.text)
        assert r.json()["code"] in ("invalid_argument", "snapshot_corrupt", "not_found"), (what, r.json())
    assert canary.read_text() == "untouched"
    with served.client() as c:
        assert c.snapshots() == []
    _no_scratch_left(served, no_leaks.home)


def test_a_folder_saved_by_another_home_is_refused(served, no_leaks, tmp_path):
    """The manifest is signed with the saving home's key: a folder saved elsewhere (or changed
    since) does not load; nothing is recorded."""
    with served.client() as c:
        snap = _snapshot_with_state(c)
        folder = snap.save(tmp_path / "saved")
        snap.remove()
        manifest = json.loads((folder / "snapshot.json").read_text())
        manifest["mac"] = "0" * len(manifest["mac"])
        (folder / "snapshot.json").write_text(json.dumps(manifest))
        with pytest.raises(InvalidArgument):
            c.load_snapshot(folder)
        assert c.snapshots() == []
        with pytest.raises(InvalidArgument, match="holds no saved snapshot"):
            c.load_snapshot(tmp_path)
    _no_scratch_left(served, no_leaks.home)


def test_an_upload_over_the_limit_is_refused_and_leaves_nothing(no_leaks, tmp_path):
    from bunshin.server.admission import Limits
    from bunshin.server.thread import serve_in_thread

    from .conftest import TOKEN

    body = _tar([_file("images/blob", b"x" * (3 << 20))])
    with serve_in_thread(no_leaks, TOKEN, limits=Limits(max_upload=1 << 20)) as url:
        served = Served(url, TOKEN)
        r = _post(served, body)  # Content-Length declared: refused before the body is read
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        assert "--max-upload" in r.json()["hint"]

        def chunks():  # no Content-Length: cut off once past the limit
            for i in range(0, len(body), 64 << 10):
                yield body[i:i + (64 << 10)]

        r = httpx.post(f"{url}/v1/snapshots/load", content=chunks(), timeout=60,
                       headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-tar"})
        assert r.status_code == 413 and r.json()["code"] == "payload_too_large", r.text
        with served.client() as c:
            assert c.snapshots() == []
    _no_scratch_left(served, no_leaks.home)


def test_an_upload_the_disk_cannot_hold_is_refused(served, no_leaks, monkeypatch):
    from bunshin.server import uploads

    real = uploads.os.statvfs

    def small_disk(path):  # the disk has 1 MiB more than the margin
        st = real(path)
        return type("St", (), {"f_bavail": (uploads.DISK_MARGIN + (1 << 20)) // st.f_frsize,
                               "f_frsize": st.f_frsize})()

    monkeypatch.setattr(uploads.os, "statvfs", small_disk)
    r = _post(served, _tar([_file("images/blob", b"x" * (2 << 20))]))
    assert r.status_code == 507 and r.json()["code"] == "resource_exhausted", r.text
    assert "bunshin gc" in r.json()["hint"]
    _no_scratch_left(served, no_leaks.home)


def test_gc_removes_what_a_dead_server_left_in_transfers(cfg):
    import subprocess

    from bunshin.runtime.state.store import Store
    from bunshin.runtime.upkeep import gc

    dead = subprocess.Popen(["true"])
    dead.wait()
    root = cfg.paths.transfers
    root.mkdir(parents=True, exist_ok=True)
    (root / f"out-{dead.pid}-0123456789abcdef").mkdir()
    (root / f"out-{dead.pid}-0123456789abcdef" / "images").mkdir()
    (root / f"in-{dead.pid}-0123456789abcdef.tar").write_bytes(b"half")
    live = root / f"in-{os.getpid()}-fedcba9876543210.tar"  # a running server's upload
    live.write_bytes(b"in flight")
    with Store.open(cfg.db_path) as store:
        report = gc.collect(cfg, store)
    assert sorted(Path(p).name for p in report.files if "/transfers/" in p) == [
        f"in-{dead.pid}-0123456789abcdef.tar", f"out-{dead.pid}-0123456789abcdef"]
    assert live.exists() and not any(str(dead.pid) in p.name for p in root.iterdir())
    live.unlink()
