"""A saved snapshot folder is untrusted input: ``snapshot load`` against an attacker.

One real snapshot is saved per module; every attack copies the folder, tampers
with it as whoever can write such a folder could, and loads it. Each must end in
one clear ``BunshinError``, leave the canary (host files the attack aims at)
untouched and leave nothing new in the home or its tmpfs. The untampered folder
still loads and restores. The pure checks have unit tests that need no root.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import (
    BunshinError,
    CriuError,
    InvalidArgument,
    ResourceExhausted,
    RuntimeFailure,
)
from bunshin.runtime import snapshot as rsnap
from bunshin.runtime.agent_host import bundle as agent_bundle
from bunshin.runtime.container import statefs
from bunshin.runtime.criu import run as criu
from bunshin.runtime.snapshot import checks as snapshot_checks
from bunshin.runtime.snapshot import folder_save
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Snapshot, Workspace
from tests.cli.test_cli import bunshin
from tests.conftest import drop_state_tmpfs

CANARY_TEXT = "host file: must stay as it is\n"
_XATTR = "SCHILY.xattr."
def _real(fn):
    """The real runtime: root, CRIU."""
    return pytest.mark.criu(pytest.mark.integration(fn))


real = _real


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def saved(cfg, tmp_path_factory) -> Path:
    """One real snapshot of a host-image workspace, saved; the workspace and snapshot removed."""
    ws = Workspace.create("host", config=cfg, memory="512M")
    try:
        ws.files.write("/root/gen", "saved\n")
        ws.commands.spawn(["sleep", "1000"])
        snap = ws.snapshot()
        try:
            folder = snap.save(tmp_path_factory.mktemp("saved") / "snap")
        finally:
            snap.remove()
    finally:
        ws.remove()
    with Store.open(cfg.db_path) as store:
        gc.collect(cfg, store)
    return folder


@pytest.fixture
def canary(tmp_path) -> Path:
    d = tmp_path / "canary"
    d.mkdir()
    (d / "keep").write_text(CANARY_TEXT)
    return d


@pytest.fixture
def attack(saved, no_leaks, tmp_path, canary):
    """A copy of the saved folder to tamper with; checks afterwards that the canary and the
    home are as they were."""
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder, symlinks=True)
    before = listing(no_leaks)
    yield folder
    assert sorted(p.name for p in canary.iterdir()) == ["keep"]
    assert (canary / "keep").read_text() == CANARY_TEXT
    assert listing(no_leaks) == before


def listing(cfg: Config) -> set[str]:
    """Every path under the home and its tmpfs (SQLite's journal files aside), not
    descending into the mounts there (a workspace's root, the id-mapped host root)."""
    out = set()
    for root in (cfg.home, cfg.tmpfs):
        mounts = set(statefs.mounts_under(root))
        for dirpath, dirnames, files in os.walk(root):
            out.update(os.path.join(dirpath, n) for n in dirnames + files if not n.startswith("state.db"))
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in mounts]
    return out


def manifest(folder: Path) -> dict:
    return json.loads((folder / "snapshot.json").read_text())


def edit(folder: Path, change) -> dict:
    m = manifest(folder)
    change(m)
    (folder / "snapshot.json").write_text(json.dumps(m))
    return m


def refused(cfg: Config, folder: Path, match: str, *, trust: bool = True, error=InvalidArgument) -> BunshinError:
    with pytest.raises(error, match=match) as info:
        Snapshot.load(folder, config=cfg, trust=trust)
    assert "\n" not in str(info.value)
    return info.value


def snap_layer(m: dict) -> dict:
    return m["layers"][0]


def add_members(archive: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> None:
    with tarfile.open(archive, "a") as tf:
        for ti, data in members:
            if data is not None:
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data) if data is not None else None)


def member(name: str, kind: bytes = tarfile.REGTYPE, **kw) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


# ------------------------------------------------------- the folder as written


@real
def test_untampered_folder_loads_and_restores(saved, no_leaks, tmp_path):
    cfg = no_leaks
    m = manifest(saved)
    assert m["mac"].startswith("hmac-sha256:") and m["memfiles"]
    assert [e["role"] for e in m["layers"]] == ["snapshot", "agent", "mask", "base"]
    assert "archive" not in m["layers"][1] and not (saved / "layers" / f"{m['layers'][1]['name']}.tar").exists()
    assert set(m["files"]) == {str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file()} - {"snapshot.json"}
    assert oct(cfg.snapshot_key_path.stat().st_mode & 0o777) == "0o600"
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder)
    snap = Snapshot.load(folder, config=cfg)
    try:
        assert snap.record.keep and snap.record.memory_limit == 512 << 20
        (clone,) = snap.restore(1)
        try:
            assert clone.files.read_text("/root/gen") == "saved\n"
            assert clone.exec(["test", "-e", str(cfg.home)]).exit_code == 1  # the mask is there
        finally:
            clone.remove()
    finally:
        snap.remove()


# ---------------------------------------------------------- authentication


@real
def test_an_edited_image_byte_is_refused_without_trust(attack, no_leaks):
    img = sorted((attack / "images").glob("*.img"))[0]
    data = bytearray(img.read_bytes())
    data[len(data) // 2] ^= 0xFF
    img.write_bytes(bytes(data))
    refused(no_leaks, attack, "altered after it was saved.*--trust", trust=False)


@real
@pytest.mark.parametrize("change", [
    lambda m: m.pop("mac"),
    lambda m: m["record"].update(hostname="other"),
    lambda m: m.update(mac="hmac-sha256:" + "0" * 64),
    lambda m: m["files"].pop(sorted(m["files"])[0]),
], ids=["unsigned", "edited-record", "forged-mac", "file-dropped"])
def test_unsigned_or_altered_manifests_are_refused_without_trust(attack, no_leaks, change):
    edit(attack, change)
    refused(no_leaks, attack, "--trust", trust=False)


@real
def test_an_extra_file_is_refused_without_trust(attack, no_leaks):
    (attack / "images" / "extra.img").write_bytes(b"x")
    refused(no_leaks, attack, "other files than it was saved with.*--trust", trust=False)


@real
def test_cli_prints_one_line_naming_trust(attack, no_leaks):
    edit(attack, lambda m: m.pop("mac"))
    r = bunshin(no_leaks, "snapshot", "load", str(attack), check=False)
    assert r.returncode == 125 and "--trust" in r.stderr and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()  # the CLI's form: one error line, its hint
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: ")


# -------------------------------------------------------- names and paths


@real
def test_an_id_with_dotdot_cannot_reach_a_host_folder(attack, no_leaks, canary):
    rel = os.path.relpath(canary, no_leaks.tmpfs / "snapshots")
    for value in (rel, str(canary)):
        def change(m, value=value):
            m["record"]["id"] = value
            snap_layer(m)["name"] = value
        edit(attack, change)
        refused(no_leaks, attack, "snapshot ids look like")


@real
@pytest.mark.parametrize("where", ["memfile-name", "layer-name", "ancestor-name"])
def test_names_with_slashes_are_refused(attack, no_leaks, canary, where):
    rel = os.path.relpath(canary, no_leaks.tmpfs / "mem")

    def change(m):
        if where == "memfile-name":
            m["memfiles"][0]["name"] = rel
        elif where == "layer-name":
            m["layers"][1]["name"] = "../" + m["layers"][1]["name"]
        else:
            m["layers"].insert(1, {**snap_layer(m), "name": "snap-../../x"})
    edit(attack, change)
    refused(no_leaks, attack, "memory file|layer names")


@real
def test_data_and_archive_paths_stay_inside_the_folder(attack, no_leaks, canary):
    original = (attack / "snapshot.json").read_text()
    archive = attack / snap_layer(manifest(attack))["archive"]
    for field, value in (("data", str(canary / "keep")), ("data", "mem/../../canary/keep"),
                         ("archive", str(archive)), ("archive", "layers/../snapshot.json")):
        (attack / "snapshot.json").write_text(original)

        def change(m, field=field, value=value):
            (m["memfiles"][0] if field == "data" else snap_layer(m))[field] = value
        edit(attack, change)
        refused(no_leaks, attack, "not a plain path inside the snapshot folder")


@real
def test_symlinked_files_and_folders_are_not_followed(saved, no_leaks, tmp_path, canary):
    before = listing(no_leaks)
    m = manifest(saved)
    data = m["memfiles"][0]["data"]
    for target in ("file", "folder", "image"):
        folder = tmp_path / f"f-{target}"
        shutil.copytree(saved, folder)
        if target == "file":  # the data file a symlink to a host file of the same length
            (canary / "data").write_bytes((folder / data).read_bytes())
            (folder / data).unlink()
            (folder / data).symlink_to(canary / "data")
        elif target == "folder":  # mem/ a symlink to a host folder
            shutil.copytree(folder / "mem", canary / "mem")
            shutil.rmtree(folder / "mem")
            (folder / "mem").symlink_to(canary / "mem")
        else:
            img = sorted((folder / "images").glob("*.img"))[0]
            img.unlink()
            img.symlink_to(canary / "keep")
        refused(no_leaks, folder, "without following a symbolic link|not a regular file")
    assert listing(no_leaks) == before and (canary / "keep").read_text() == CANARY_TEXT


# ------------------------------------------------------------ layer stack


@real
def test_the_agent_layer_is_never_taken_from_the_folder(saved, tmp_path):
    """A fresh home (no agent layer yet): the folder brings one with an extra file; the home builds its own."""
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder)
    name = agent_bundle.current_layer_name()
    evil = tmp_path / "evil"
    (evil / ".bunshin").mkdir(parents=True)
    (evil / ".bunshin" / "planted").write_text("agent of the attacker\n")
    subprocess.run(["tar", "--create", "--file", str(folder / "layers" / f"{name}.tar"), "--directory", str(evil),
                    "."], check=True)
    edit(folder, lambda m: m["layers"][1].update(archive=f"layers/{name}.tar"))
    other = Config.for_home(tmp_path / "home2", criu=Config.from_env().criu)
    try:
        loaded = Snapshot.load(folder, config=other, trust=True)
        layer = other.tmpfs / "layers" / name
        assert loaded.record.lowers[0] == str(layer) and (layer / ".bunshin" / "agent").is_dir()
        assert not (layer / ".bunshin" / "planted").exists()
        loaded.remove()
    finally:
        with Store.open(other.db_path) as store:
            for s in rsnap.list_all(store):
                rsnap.remove(other, store, s)
        drop_state_tmpfs(other)


@real
def test_another_agent_version_is_refused_with_a_hint(attack, no_leaks):
    edit(attack, lambda m: m["layers"][1].update(name="agent-0123456789ab"))
    err = refused(no_leaks, attack, "agent layer agent-0123456789ab")
    assert "another bunshin version" in err.hint


@pytest.mark.parametrize("change", [
    lambda m: m["layers"].pop(2),  # the mask left out: state.db and /opt/bunshin visible
    lambda m: m["layers"].insert(1, m["layers"].pop(2)),  # the mask above the agent
    lambda m: m["layers"].insert(2, dict(m["layers"][2])),  # two masks
    lambda m: m["layers"].pop(1),  # no agent layer
    lambda m: m["layers"][-1].update(path="/var"),  # another base for the host image
    lambda m: (m["record"].update(image="/srv/x"), m["layers"].pop(2), m["layers"][-1].update(path="/")),
    lambda m: (m["record"].update(image="/srv/x"), m["layers"].pop(2), m["layers"][-1].update(path="/var/lib")),
], ids=["no-mask", "mask-above-agent", "two-masks", "no-agent", "host-base-moved", "image-is-root",
        "image-over-home"])
@real
def test_the_stack_keeps_its_shape(attack, no_leaks, change):
    edit(attack, change)
    refused(no_leaks, attack, "layer stack|base")


# ------------------------------------------------------------------ limits


@real
@pytest.mark.parametrize(("field", "value"), [
    ("memory_limit", 1 << 62), ("memory_limit", -1), ("memory_limit", "2G"), ("memory_limit", True),
    ("pids_limit", 10**9), ("pids_limit", 0), ("pids_limit", 3.5),
])
def test_absurd_limits_are_refused(attack, no_leaks, field, value):
    edit(attack, lambda m: m["record"].update({field: value}))
    refused(no_leaks, attack, "limit")


@real
def test_null_limits_get_the_create_defaults(saved, no_leaks, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder)
    edit(folder, lambda m: m["record"].update(memory_limit=None, pids_limit=None))
    snap = Snapshot.load(folder, config=no_leaks, trust=True)
    try:
        assert (snap.record.memory_limit, snap.record.pids_limit) == (2 << 30, 512)
    finally:
        snap.remove()


# -------------------------------------------------------------- layer tars


def _tar_attacks(canary: Path) -> dict[str, tuple[list, str]]:
    return {
        "char-device": ([(member("dev/console", tarfile.CHRTYPE, devmajor=5, devminor=1, mode=0o666), None)],
                        "device node 5:1"),
        "block-device": ([(member("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0), None)], "type"),
        "setuid": ([(member("usr/local/bin/su", mode=0o4755), b"#!/bin/sh\n")], "setuid"),
        "sticky-file": ([(member("tmp/sticky", mode=0o1644), b"x")], "setuid, setgid or sticky"),
        "dotdot": ([(member("../../../escape"), b"x")], "'..'"),
        "absolute": ([(member(str(canary / "abs")), b"x")], "absolute"),
        "symlink-then-file": ([(member("esc", tarfile.SYMTYPE, linkname=str(canary)), None),
                               (member("esc/pwned"), b"x")], "below the symbolic link"),
        "hardlink-outside": ([(member("hl", tarfile.LNKTYPE, linkname=str(canary / "keep")), None)], "hard link"),
        "hardlink-to-symlink": ([(member("s", tarfile.SYMTYPE, linkname=str(canary / "keep")), None),
                                 (member("hl", tarfile.LNKTYPE, linkname="s"), None)], "hard link"),
        "memory-view-symlink": ([(member(".bunshin", tarfile.SYMTYPE, linkname=str(canary)), None)],
                                "memory-file view|twice"),
        "foreign-owner": ([(member("etc/x", uid=12345, gid=12345), b"x")], "owned by 12345"),
        "opaque-file": ([(member("opq", pax_headers={f"{_XATTR}trusted.overlay.opaque": "y"}), b"x")],
                        "overlayfs writes 'y', on folders only"),
        "opaque-x": ([(member("opqdir", tarfile.DIRTYPE, mode=0o755,
                              pax_headers={f"{_XATTR}trusted.overlay.opaque": "x"}), None)], "overlayfs writes 'y'"),
        "libarchive-xattr": ([(member("la", pax_headers={"LIBARCHIVE.xattr.trusted.overlay.redirect": "L2V0Yw=="}),
                               b"x")], "libarchive's form"),
    }


@real
@pytest.mark.parametrize("kind", list(_tar_attacks(Path("/x"))))
def test_dangerous_tar_members_are_refused(attack, no_leaks, canary, kind):
    members, why = _tar_attacks(canary)[kind]
    add_members(attack / snap_layer(manifest(attack))["archive"], *members)
    refused(no_leaks, attack, why)


@real
def test_a_file_that_is_no_tar_is_refused(attack, no_leaks):
    (attack / snap_layer(manifest(attack))["archive"]).write_bytes(b"\x01" * 10000)
    refused(no_leaks, attack, "not a tar archive")


@real
def test_overlay_and_security_xattrs_of_a_layer_are_not_loaded(saved, no_leaks, tmp_path):
    """A trusted folder's layer carries overlayfs's redirect and metacopy (they would point the
    overlay at other files of the stack: the host's, past the mask) and a capability: loaded
    without them; the workspace's own user.* xattrs and an opaque folder stay."""
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder)
    cap = "\x01\x00\x00\x02" + "\x00" * 16  # v2: cap_* on the host
    add_members(folder / snap_layer(manifest(folder))["archive"],
                (member("redir", tarfile.DIRTYPE, mode=0o755, pax_headers={
                    f"{_XATTR}trusted.overlay.redirect": "/etc", f"{_XATTR}trusted.overlay.opaque": "y",
                    f"{_XATTR}user.note": "kept", f"{_XATTR}security.capability": cap}), None),
                (member("meta", pax_headers={f"{_XATTR}trusted.overlay.metacopy": "",
                                             f"{_XATTR}trusted.overlay.redirect": "/etc/shadow",
                                             f"{_XATTR}security.capability": cap}), b"x"))
    snap = Snapshot.load(folder, config=no_leaks, trust=True)
    try:
        layer = Path(snap.record.layer)
        assert xattrs(layer / "redir") == {"trusted.overlay.opaque": b"y", "user.note": b"kept"}
        assert xattrs(layer / "meta") == {} and (layer / "meta").read_bytes() == b"x"
    finally:
        snap.remove()


def xattrs(path: Path) -> dict[str, bytes]:
    return {x: os.getxattr(path, x, follow_symlinks=False) for x in os.listxattr(path, follow_symlinks=False)}


@real
@pytest.mark.parametrize("base", ["canary", "/etc"])
def test_a_trusted_folder_cannot_stack_on_a_host_folder_bunshin_does_not_know(attack, no_leaks, canary, base):
    """Even with --trust, a folder's base is 'host', stored image layers or a folder image
    this home's workspaces or snapshots use: never any host folder it names."""
    path = str(canary) if base == "canary" else base

    def change(m):
        m["record"].update(image=path)
        m["layers"].pop(2)  # no mask: a folder image has none
        m["layers"][-1].update(path=path)
    edit(attack, change)
    err = refused(no_leaks, attack, f"base image {path} is a host folder this home does not know as an image")
    assert "bunshin create --image" in (err.hint or "")


# ------------------------------------------------------ memory files, sizes


@real
@pytest.mark.parametrize("change", [
    lambda m: m["extents"].reverse() if len(m["extents"]) > 1 else m["extents"].append([0, 1]),
    lambda m: m["extents"].append(list(m["extents"][-1])),
    lambda m: m.update(size=m["extents"][-1][0]),
    lambda m: m.update(extents=[["0", "4096"]]),
    lambda m: m.update(extents={"0": 4096}),
    lambda m: m.update(extents=[[0, -4096]]),
    lambda m: m.update(size=1 << 50),
    lambda m: m.update(extents=m["extents"][:-1]),  # no longer the data file's size
], ids=["unsorted", "overlapping", "beyond-size", "strings", "not-a-list", "negative", "huge-size", "sum"])
def test_bad_extents_are_a_clear_error(attack, no_leaks, change):
    edit(attack, lambda m: change(m["memfiles"][0]))
    refused(no_leaks, attack, "memory file")


@real
def test_sizes_must_fit_tmpfs_and_memory(attack, no_leaks):
    m = manifest(attack)
    data = attack / m["memfiles"][0]["data"]
    os.truncate(data, 1 << 40)  # sparse: costs no disk here, 1 TiB on tmpfs

    def change(m):
        m["memfiles"][0].update(size=1 << 41, extents=[[0, 1 << 40]])
    edit(attack, change)
    refused(no_leaks, attack, "needs", error=ResourceExhausted)


# ------------------------------------------------------------------- save


def test_save_takes_only_the_real_memory_files(tmp_path, canary):
    """A workspace may plant anything in its memory-file view: a symlink named for the snapshot is refused,
    other names are left out, nothing is read through a link."""
    cfg = Config.for_home(tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    layer = cfg.tmpfs / "layers" / "snap-0123456789ab"
    view = layer / ".bunshin" / "mem"
    view.mkdir(parents=True)
    (cfg.tmpfs / "mem").mkdir()
    real = cfg.tmpfs / "mem" / "snap-0123456789ab-7.bunshin-mem"
    real.write_bytes(b"x" * 4096)
    os.link(real, view / real.name)
    (view / "snap-999999999999-1.bunshin-mem").symlink_to(canary / "keep")  # someone else's name: skipped
    out = tmp_path / "out"
    (entry,) = folder_save._save_memfiles(cfg, layer, out, set())
    assert entry["name"] == real.name and sorted(p.name for p in out.iterdir()) == [real.name]
    # a live pre-copy's file the layer links is taken too, once for the whole stack
    live = cfg.tmpfs / "mem" / "live-ws-0123456789ab-0a1b2c3d.bunshin-mem"
    live.write_bytes(b"z" * 8192)
    os.link(live, view / live.name)
    saved: set[str] = set()
    got = folder_save._save_memfiles(cfg, layer, tmp_path / "out1", saved)
    assert sorted(e["name"] for e in got) == sorted([live.name, real.name]) and saved == {real.name, live.name}
    assert [e["name"] for e in folder_save._save_memfiles(cfg, layer, tmp_path / "out1b", saved)] == [real.name]
    for bad in ("snap-0123456789ab-8.bunshin-mem", "live-ws-0123456789ab-deadbeef.bunshin-mem"):
        (view / bad).symlink_to(canary / "keep")
        with pytest.raises(RuntimeFailure, match="cannot be opened safely"):
            folder_save._save_memfiles(cfg, layer, tmp_path / "out2", set())
        (view / bad).unlink()
        (view / bad).write_bytes(b"y")  # a regular file, not the host's memory file
        with pytest.raises(RuntimeFailure, match="not the memory file"):
            folder_save._save_memfiles(cfg, layer, tmp_path / "out3", set())
        (view / bad).unlink()
    shutil.rmtree(view)
    view.parent.joinpath("mem").symlink_to(canary)  # the view itself a link to a host folder
    assert folder_save._save_memfiles(cfg, layer, tmp_path / "out4", set()) == []


# ------------------------------------------------------ pure checks (no root)


def test_extents_checks():
    assert snapshot_checks.check_extents([[0, 4096], [8192, 4096]], 1 << 20, "f") == 8192
    assert snapshot_checks.check_extents([], 0, "f") == 0
    for ext, size in (([[4096, 1], [0, 1]], 8192), ([[0, 8192], [4096, 1]], 1 << 20), ([[0, 1]], 0),
                      ([[True, 1]], 10), ([[0, 1, 2]], 10), ([(0, 1)], 10), ([[0, 1]], 1 << 48), ([[0, 0]], 10)):
        with pytest.raises(InvalidArgument):
            snapshot_checks.check_extents(ext, size, "f")


def test_relative_path_checks():
    assert snapshot_checks.rel_parts("mem/a", "x") == ["mem", "a"]
    for bad in ("/etc/passwd", "../x", "mem/../x", "mem//x", "", ".", "a/./b", 3, None, "a\0b"):
        with pytest.raises(InvalidArgument):
            snapshot_checks.rel_parts(bad, "x")


def test_limit_checks_and_defaults():
    import inspect

    from bunshin.runtime.container import lifecycle as container
    from bunshin.runtime.container.cgroups import parse_size

    params = inspect.signature(container.create).parameters  # the defaults put back are `create`'s own
    assert (params["memory"].default, params["pids"].default) == (snapshot_checks.DEFAULT_MEMORY, snapshot_checks.DEFAULT_PIDS)
    total = 8 << 30
    assert snapshot_checks.check_limits(None, None, memory_total=total, pid_max=32768) == (parse_size("2G"), 512)
    assert snapshot_checks.check_limits(total, 32768, memory_total=total, pid_max=32768) == (total, 32768)
    for mem, pids in ((total + 1, 10), (0, 10), (1 << 30, 32769), (1 << 30, 7), (1.0 * (1 << 30), 10)):
        with pytest.raises(InvalidArgument):
            snapshot_checks.check_limits(mem, pids, memory_total=total, pid_max=32768)


def test_tar_member_checks_accept_what_save_writes(tmp_path):
    layer = tmp_path / "l"
    (layer / "a").mkdir(parents=True)
    (layer / ".bunshin" / "mem").mkdir(parents=True)
    (layer / "a" / "sparse").write_bytes(b"")
    os.truncate(layer / "a" / "sparse", 1 << 30)
    (layer / "a" / "f").write_text("hi\n")
    os.link(layer / "a" / "f", layer / "hard")
    os.mkfifo(layer / "fifo")
    os.mknod(layer / "wh", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    (layer / "link").symlink_to("/etc/passwd")
    (layer / "tmpdir").mkdir(mode=0o1777)
    os.chmod(layer / "tmpdir", 0o1777)
    (layer / "sgid").mkdir()
    os.chmod(layer / "sgid", 0o2775)
    archive = tmp_path / "x.tar"
    folder_save._tar(layer, archive)
    with tarfile.open(archive) as tf:
        snapshot_checks.check_tar_members(tf, "snap-0123456789ab", range(10**9, 10**9 + 65536))


def test_the_safe_devices_are_those_of_a_workspace_dev():
    from bunshin.runtime.container import lifecycle as container

    devices = getattr(container, "_DEVICES", None)
    if devices is None:
        pytest.skip("container makes no /dev nodes")
    assert {tuple(d) for d in devices.values()} | {(0, 0)} == snapshot_checks.SAFE_DEVICES


def test_mac_is_over_the_canonical_manifest():
    key = os.urandom(32)
    m = {"format": snapshot_checks.FORMAT, "record": {"a": 1.5, "b": [1, 2]}, "files": {}}
    signed = {**m, "mac": snapshot_checks.mac(key, m)}
    reordered = json.loads(json.dumps(dict(reversed(list(signed.items())))))
    assert snapshot_checks.mac(key, reordered) == signed["mac"] != snapshot_checks.mac(os.urandom(32), m)
    assert snapshot_checks.mac(key, {**m, "record": {"a": 1.5, "b": [2, 1]}}) != signed["mac"]


def test_criu_dump_and_restore_have_timeouts_that_kill(tmp_path):
    import inspect

    assert inspect.signature(criu.dump).parameters["timeout"].default == criu.DUMP_TIMEOUT_S
    assert inspect.signature(criu.restore).parameters["timeout"].default == criu.RESTORE_TIMEOUT_S
    fake = tmp_path / "criu"
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 60\n")
    fake.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(CriuError, match="timed out"):
        criu.restore(fake, tmp_path / "img", pidfile=tmp_path / "x.pid", timeout=0.5)
    assert time.monotonic() - t0 < 10
    pid = int((tmp_path / "pid").read_text())
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_saved_live_files_are_named_for_a_workspace_and_go_with_a_snapshot_layer():
    check_memfiles = snapshot_checks.check_memfiles
    def entry(name, layer):
        return {"name": name, "layer": layer, "size": 4096, "extents": [[0, 4096]], "data": f"mem/{name}"}

    ok = entry("live-ws-0123456789ab-0a1b2c3d.bunshin-mem", "snap-0123456789ab")
    assert check_memfiles([ok], ["snap-0123456789ab"]) == [ok]
    for bad in (entry(ok["name"], "snap-ffffffffffff"),  # no such layer in the stack
                entry("live-ws-0123456789ab-0a1b2c3d.bunshin-mem/../x", "snap-0123456789ab"),
                entry("live-../../etc-0a1b2c3d.bunshin-mem", "snap-0123456789ab"),
                entry("live-ws-0123456789ab-0a1b2c3.bunshin-mem", "snap-0123456789ab")):
        with pytest.raises(InvalidArgument, match="live pre-copy"):
            check_memfiles([bad], ["snap-0123456789ab"])
    with pytest.raises(InvalidArgument):  # once only
        check_memfiles([ok, dict(ok)], ["snap-0123456789ab"])
