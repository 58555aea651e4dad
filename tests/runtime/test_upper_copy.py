"""The frozen copy of an upper folder (``upper_copy.c``): what ``cp -a`` makes, nothing followed.

A tree with every kind of entry an overlay upper holds (whiteouts, opaque folders, hard
links, holes, set-id bits, file capabilities, odd names, host ids, exact times, symlinks
aimed at a host canary) is copied by the copier and by ``cp -a`` side by side, and the two
copies must agree in every property; then the failure paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import BunshinError
from bunshin.runtime.memfile import criu_images
from bunshin.runtime.snapshot import upper_copy

pytestmark = pytest.mark.integration

ID = 1_000_000_000 + 5  # a workspace's root as the host sees it
CAP_NET_BIND = bytes.fromhex("0100000200040000000000000000000000000000")  # vfs_cap_data v2: cap_net_bind_service


def _build_tree(top: Path, canary: Path) -> None:
    top.mkdir()
    (top / "etc").mkdir()
    (top / "etc" / "hosts").write_text("127.0.0.1 here\n")
    os.chown(top / "etc" / "hosts", ID, ID)
    with open(top / "sparse", "wb") as f:  # data, a 4 MiB hole, data, a hole to the end
        f.write(b"a" * 8192)
        f.seek(4 << 20)
        f.write(b"b" * 4096)
        f.truncate(16 << 20)
    (top / "empty").touch()
    (top / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(top / "suid", 0o4755)
    (top / "capped").write_bytes(b"\x7fELF")
    os.setxattr(top / "capped", "security.capability", CAP_NET_BIND)
    (top / "opaque").mkdir()
    os.setxattr(top / "opaque", "trusted.overlay.opaque", b"y")
    os.mknod(top / "opaque" / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # an overlay whiteout
    os.setxattr(top / "opaque" / "gone", "trusted.overlay.whiteout", b"")
    os.mkfifo(top / "fifo", 0o640)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(top / "sock"))
    (top / "tmp").mkdir(mode=0o1777)
    os.chmod(top / "tmp", 0o1777)
    (top / "ro").mkdir()
    (top / "ro" / "inside").write_text("read-only folder\n")
    os.chmod(top / "ro", 0o500)
    (top / "a").mkdir()
    (top / "a" / "one").write_text("linked\n")
    os.link(top / "a" / "one", top / "two")
    os.link(top / "a" / "one", top / "ro" / "three")
    os.symlink(str(canary), top / "to-canary")  # absolute, at a host file
    os.symlink("../../../../../../" + str(canary).lstrip("/"), top / "a" / "up-and-out")
    os.symlink(str(canary.parent), top / "to-host-dir")
    os.symlink("nowhere", top / "dangling")
    os.setxattr(top / "dangling", "trusted.bunshin", b"on the link", follow_symlinks=False)
    os.lchown(top / "dangling", ID, ID + 1)
    odd = os.fsencode(top) + b"/new\nline \xff\xfe name"
    with open(odd, "wb") as f:
        f.write(b"odd\n")
    deep = top
    for i in range(40):
        deep = deep / f"d{i}"
    deep.mkdir(parents=True)
    (deep / "leaf").write_text("deep\n")
    os.setxattr(top / "etc" / "hosts", "user.note", b"kept")
    for path in [top / "etc" / "hosts", top / "sparse", top / "a", top]:
        os.utime(path, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321), follow_symlinks=False)
    os.utime(top / "dangling", ns=(1_400_000_000_000_000_001, 1_400_000_000_000_000_002), follow_symlinks=False)


def _xattrs(path: Path) -> dict[str, bytes]:
    return {k: os.getxattr(path, k, follow_symlinks=False) for k in os.listxattr(path, follow_symlinks=False)}


def _describe(top: Path) -> dict[bytes, tuple]:
    """Every property the two copies must share, by path; hard links as groups of names."""
    out: dict[bytes, tuple] = {}
    groups: dict[int, list[bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(os.fsencode(top)):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, os.fsencode(top))
            st = os.lstat(p)
            kind = stat.S_IFMT(st.st_mode)
            content = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
                groups.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            mtime = st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) or name else None
            out[rel] = (kind, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_size, st.st_rdev,
                        mtime, content, _xattrs(Path(os.fsdecode(p))), st.st_nlink if kind != stat.S_IFDIR else None)
    out[b"<links>"] = tuple(sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1))
    return out


def _copy(cfg: Config, src: Path, dst: Path, folder: Path) -> None:
    folder.mkdir(exist_ok=True)
    with upper_copy.frozen_copy(cfg, src, dst, folder, None) as copy:
        copy.run()


def test_the_copy_is_what_cp_a_makes_and_follows_nothing(cfg, tmp_path):
    canary = tmp_path / "host" / "canary"
    canary.parent.mkdir()
    canary.write_text("host secret\n")
    src = tmp_path / "upper"
    _build_tree(src, canary)
    subprocess.run(["cp", "-a", "--sparse=always", str(src), str(tmp_path / "by-cp")], check=True)
    _copy(cfg, src, tmp_path / "by-copier", tmp_path / "work")
    want, got = _describe(tmp_path / "by-cp"), _describe(tmp_path / "by-copier")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == want[key], key
    mine = tmp_path / "by-copier"
    assert (mine / "sparse").stat().st_blocks * 512 < 1 << 20  # the holes stayed holes
    assert os.stat(mine).st_mtime_ns == os.stat(src).st_mtime_ns and os.stat(mine).st_mode == os.stat(src).st_mode
    assert canary.read_text() == "host secret\n" and sorted(p.name for p in canary.parent.iterdir()) == ["canary"]
    assert os.readlink(mine / "to-canary") == str(canary)  # a link, never its target's bytes
    assert not (mine / "to-host-dir").is_dir() or (mine / "to-host-dir").is_symlink()


def test_a_copier_told_nothing_leaves_nothing(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    (src / "f").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    with upper_copy.frozen_copy(cfg, src, tmp_path / "layer", work, None):
        pass  # the dump failed before its post-dump stage
    assert not (tmp_path / "layer").exists()
    assert sorted(p.name for p in work.iterdir()) == [upper_copy.LOG]  # its fifos are gone


def test_a_copy_that_fails_says_why(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    (tmp_path / "layer").mkdir()  # taken already
    with pytest.raises(BunshinError, match="make .*layer.*File exists"):
        _copy(cfg, src, tmp_path / "layer", tmp_path / "work")
    with pytest.raises(BunshinError, match="open .*no-upper"):
        _copy(cfg, tmp_path / "no-upper", tmp_path / "layer2", tmp_path / "work2")
    assert not (tmp_path / "layer2").exists()


def test_a_copier_killed_before_its_go_is_an_error_not_a_hang(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    with upper_copy.frozen_copy(cfg, src, tmp_path / "layer", work, None) as copy:
        os.kill(copy.pid, 9)
        with pytest.raises(BunshinError, match="ended without saying why"):
            copy.run()
    assert not (tmp_path / "layer").exists()


def test_the_copier_is_built_once_per_source(cfg, tmp_path):
    first = upper_copy.build(tmp_path / "helpers")
    assert first == upper_copy.build(tmp_path / "helpers") and os.access(first, os.X_OK)
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    shutil.rmtree(tmp_path / "helpers")


def _remaps(images: Path, *types: str) -> None:
    entries = [{"orig_id": i + 1, "remap_id": i + 100, "remap_type": t} for i, t in enumerate(types)]
    criu_images.save({"magic": "REMAP_FPATH", "entries": entries}, images / upper_copy.REMAPS)


def test_an_early_copy_is_made_at_its_go_and_run_only_waits(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    (src / "f").write_text("x")
    work, images = tmp_path / "work", tmp_path / "images"
    work.mkdir()
    images.mkdir()
    with upper_copy.frozen_copy(cfg, src, tmp_path / "layer", work, None, early=images) as copy:
        assert set(copy.notify) == {"pre-dump", "query-ext-files", "post-dump"}
        copy.notify["query-ext-files"]()  # CRIU: every task is frozen
        deadline = time.monotonic() + 30
        while not (tmp_path / "layer" / "f").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "layer" / "f").read_text() == "x"  # copied before post-dump
        copy.notify["post-dump"]()  # waits for the answer; no remaps: nothing raised
    late = tmp_path / "late"
    with upper_copy.frozen_copy(cfg, src, late, work, None) as copy:
        assert "query-ext-files" not in copy.notify
        copy.run()
    assert (late / "f").read_text() == "x"


def test_linked_remaps_are_told_from_ghosts(tmp_path):
    assert not upper_copy.linked_remaps(tmp_path)  # CRIU writes none when there are none
    _remaps(tmp_path, "GHOST", "PROCFS")  # a ghost (its bytes in the images) and a dead process's /proc
    assert not upper_copy.linked_remaps(tmp_path)
    _remaps(tmp_path, "GHOST", "LINKED")  # and a file CRIU linked back into the tree
    assert upper_copy.linked_remaps(tmp_path)
    (tmp_path / upper_copy.REMAPS).write_bytes(b"not an image")
    assert upper_copy.linked_remaps(tmp_path)  # unreadable: counted as one


def test_an_early_copy_after_a_linked_remap_asks_for_the_late_one(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    (src / "f").write_text("x")
    work, images, layer = tmp_path / "work", tmp_path / "images", tmp_path / "layer"
    work.mkdir()
    images.mkdir()
    with upper_copy.frozen_copy(cfg, src, layer, work, None, early=images) as copy:
        copy.notify["query-ext-files"]()
        _remaps(images, "LINKED")  # CRIU linked an open file back meanwhile
        with pytest.raises(upper_copy.LinkedRemaps):
            copy.notify["post-dump"]()
    upper_copy.start_over(images, layer)
    assert not layer.exists() and images.is_dir() and not any(images.iterdir())


def test_the_copier_ends_only_once_the_dump_is_over(cfg, tmp_path):
    src = tmp_path / "upper"
    src.mkdir()
    (src / "f").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    with upper_copy.frozen_copy(cfg, src, tmp_path / "layer", work, None) as copy:
        copy.run()
        # answered, and still there: its exit (and its reaping here) is not inside the pause
        stat_line = Path(f"/proc/{copy.pid}/stat").read_text()
        assert stat_line.rsplit(")", 1)[1].split()[0] in ("S", "R")
        pid = copy.pid
    assert (tmp_path / "layer" / "f").read_text() == "x"
    try:
        assert "upper-copy" not in Path(f"/proc/{pid}/cmdline").read_text()  # reused by now, if at all
    except FileNotFoundError:
        pass  # awaited: gone
