"""Hostile and broken images (issue 11): layer tars that climb out with ``..``, name
absolute paths, write through a symlink they planted, hard-link host files, bring
device nodes or ids outside the workspaces' range, or redirect the overlay through
an xattr; blobs whose digest does not match; truncated and corrupt archives; a full
disk. Each gets a clear error, leaves nothing half-stored (no layer, no image, no
staging) and writes nothing outside the store (canaries the test plants)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound, InvalidArgument, ResourceExhausted
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.store import Store
from bunshin.workspace import Workspace
from tests.runtime import oci_images as oi

pytestmark = pytest.mark.integration


@pytest.fixture
def home(tmp_path: Path):
    cfg = Config.for_home(tmp_path / "home")
    with Store.open(cfg.db_path) as store:
        yield cfg, store


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    """A folder outside the store a hostile layer aims at; it must stay as it is."""
    d = tmp_path / "canary"
    d.mkdir()
    (d / "victim").write_text("original\n")
    return d


BASE_DIFF_ID = "sha256:" + __import__("hashlib").sha256(oi.busybox_base().tar_bytes()).hexdigest()


def nothing_stored(cfg: Config, store: Store) -> None:
    """No image, no layer but the intact busybox base, no staging."""
    assert oci_store.list_images(store) == []
    assert set(oci_store.stored_layers(cfg)) <= {BASE_DIFF_ID}
    staging = cfg.paths.image_staging
    assert not staging.is_dir() or list(staging.iterdir()) == []


def canary_intact(canary: Path) -> None:
    assert sorted(p.name for p in canary.iterdir()) == ["victim"]
    assert (canary / "victim").read_text() == "original\n"


def load_layers(tmp_path: Path, cfg: Config, store: Store, *layers: oi.Layer) -> None:
    layout = tmp_path / f"layout-{os.urandom(3).hex()}"
    oi.build_layout(layout, [oi.busybox_base(), *layers])
    oci_store.load(cfg, store, layout)


def hostile_layers(canary: Path) -> dict[str, tuple[oi.Layer, str]]:
    rel_up = "../" * 12 + str(canary).lstrip("/")
    return {
        "dotdot": (oi.Layer().add(f"{rel_up}/pwned", "file", "x"), "goes up with '..'"),
        "absolute": (oi.Layer().add(f"{canary}/pwned", "file", "x"), "absolute path"),
        "symlink-then-write": (oi.Layer().add("evil", "symlink", str(canary)).add("evil/pwned", "file", "x"),
                               "not a folder of this layer"),
        "relative-symlink-then-write": (
            oi.Layer().add("a", "dir").add("a/up", "symlink", "../../../../../../../../..").add(
                f"a/up/{str(canary).lstrip('/')}/pwned", "file", "x"), "not a folder of this layer"),
        "symlink-then-overwrite": (oi.Layer().add("v", "symlink", str(canary / "victim"))
                                   .add("v", "file", "overwritten\n"), None),  # replaced, not followed
        "hardlink-up": (oi.Layer().add("h", "hardlink", rel_up + "/victim"), "goes up with '..'"),
        "hardlink-absolute": (oi.Layer().add("h", "hardlink", str(canary / "victim")), "absolute path"),
        "hardlink-through-symlink": (oi.Layer().add("s", "symlink", str(canary)).add("h", "hardlink", "s/victim"),
                                     "not a folder of this layer"),
        "char-device": (oi.Layer().add("dev/mem", "chr", (1, 1)), "device node"),
        "whiteout-dotdot": (oi.Layer().add("etc/.wh...", "file", b""), "names no entry"),
        "uid-outside-range": (oi.Layer().add("x", "file", "x", 0o644, 70000), "outside the workspaces'"),
    }


@pytest.mark.parametrize("case", list(hostile_layers(Path("/c"))))
def test_a_hostile_layer_is_refused_and_nothing_is_written(case: str, tmp_path: Path, home, canary: Path) -> None:
    cfg, store = home
    layer, why = hostile_layers(canary)[case]
    if why is None:  # a later member replaces a symlink the layer made: the target is never touched
        load_layers(tmp_path, cfg, store, layer)
        (rec,) = oci_store.list_images(store)
        top = cfg.paths.image_layer(rec.layers[-1])
        assert (top / "v").read_text() == "overwritten\n" and not (top / "v").is_symlink()
        canary_intact(canary)
        return
    with pytest.raises(InvalidArgument, match=why) as exc:
        load_layers(tmp_path, cfg, store, layer)
    assert exc.value.hint
    nothing_stored(cfg, store)
    canary_intact(canary)


def test_block_device_and_overlay_xattrs(tmp_path: Path, home) -> None:
    cfg, store = home
    with pytest.raises(InvalidArgument, match="device node"):
        load_layers(tmp_path, cfg, store, oi.Layer().add("disk", "chr", (8, 0)))
    nothing_stored(cfg, store)
    # a pax xattr that would redirect overlayfs to another path is dropped, not applied
    layout = tmp_path / "xattr"
    oi.build_layout(layout, [oi.busybox_base()])
    buf = tmp_path / "x.tar"
    with tarfile.open(buf, "w", format=tarfile.PAX_FORMAT) as tar:
        ti = tarfile.TarInfo("d")
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        ti.pax_headers = {"SCHILY.xattr.trusted.overlay.redirect": "/etc", "SCHILY.xattr.security.capability": "x"}
        tar.addfile(ti)
    oi.build_layout(tmp_path / "xattr2", [oi.busybox_base(), _RawLayer(buf.read_bytes())])
    (rec,) = oci_store.load(cfg, store, tmp_path / "xattr2")
    d = cfg.paths.image_layer(rec.layers[-1]) / "d"
    assert d.is_dir() and [x for x in os.listxattr(d) if not x.startswith("system.")] == []


class _RawLayer(oi.Layer):
    def __init__(self, data: bytes) -> None:
        super().__init__(compress="gzip")
        self.data = data

    def tar_bytes(self) -> bytes:
        return self.data


def _layout(tmp_path: Path) -> tuple[Path, dict]:
    layout = tmp_path / "good"
    info = oi.build_layout(layout, [oi.busybox_base(), oi.Layer().add("f", "file", "f\n")])
    return layout, info


def test_a_blob_whose_digest_does_not_match_is_refused(tmp_path: Path, home) -> None:
    cfg, store = home
    layout, info = _layout(tmp_path)
    blob = layout / "blobs" / "sha256" / json.loads(
        (layout / "blobs/sha256" / info["manifest"][7:]).read_text())["layers"][1]["digest"][7:]
    other = gzip.compress(oi.Layer().add("f", "file", "evil\n").tar_bytes())
    blob.write_bytes(other)  # same name, other content
    with pytest.raises(InvalidArgument, match="digest"):
        oci_store.load(cfg, store, layout)
    assert oci_store.list_images(store) == []
    assert len(oci_store.stored_layers(cfg)) == 1, "the intact base layer only; not the replaced one"
    assert not list(cfg.paths.image_staging.iterdir())


def test_an_edited_config_or_manifest_is_refused(tmp_path: Path, home) -> None:
    cfg, store = home
    layout, info = _layout(tmp_path)
    config = layout / "blobs/sha256" / info["config"][7:]
    doc = json.loads(config.read_text())
    doc["config"] = {"User": "0"}
    config.write_text(json.dumps(doc))
    with pytest.raises(InvalidArgument, match="digest"):
        oci_store.load(cfg, store, layout)
    nothing_stored(cfg, store)


@pytest.mark.parametrize("damage", ["truncated", "corrupt-gzip", "not-an-image"])
def test_a_damaged_archive_gets_a_clear_error(damage: str, tmp_path: Path, home) -> None:
    cfg, store = home
    layout, _ = _layout(tmp_path)
    archive = oi.docker_archive(layout, tmp_path / "d.tar", "t/d:1")
    if damage == "truncated":
        data = archive.read_bytes()
        archive.write_bytes(data[: len(data) * 2 // 3])
    elif damage == "corrupt-gzip":
        gz = oi.compress(archive, "gz")
        data = bytearray(gz.read_bytes())
        data[len(data) // 2: len(data) // 2 + 64] = os.urandom(64)
        gz.write_bytes(bytes(data))
        archive = gz
    else:
        archive.write_bytes(b"hello, not an archive\n" * 100)
    with pytest.raises(InvalidArgument) as exc:
        oci_store.load(cfg, store, archive)
    assert exc.value.hint
    assert oci_store.list_images(store) == []
    assert not cfg.paths.image_staging.is_dir() or not list(cfg.paths.image_staging.iterdir())


def test_unknown_image_references(home, tmp_path: Path, cfg: Config) -> None:
    _, store = home
    with pytest.raises(ImageNotFound, match="no stored image"):
        oci_store.find(store, "nosuch/image:1")
    with pytest.raises(ImageNotFound, match="neither a folder nor a stored image") as exc:
        Workspace.create("nosuch/image:1", config=cfg)
    assert "image pull" in (exc.value.hint or "")
    with pytest.raises(ImageNotFound, match="no image file or folder"):
        oci_store.load(cfg, store, tmp_path / "missing.tar")
    with pytest.raises(ImageNotFound):
        oci_store.find(store, "Bad Ref")


def test_a_full_disk_stores_nothing(tmp_path: Path) -> None:
    home = tmp_path / "small"
    home.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "bunshin-test-small", str(home)], check=True)
    try:
        cfg = Config.for_home(home)
        layout, _ = _layout(tmp_path)  # busybox alone is ~2 MiB
        with Store.open(cfg.db_path) as store:
            with pytest.raises(ResourceExhausted, match="no room") as exc:
                oci_store.load(cfg, store, layout)
            assert "free disk space" in (exc.value.hint or "")
            nothing_stored(cfg, store)
            assert oci_store.stored_layers(cfg) == []
    finally:
        subprocess.run(["umount", str(home)], check=True)


def test_an_oci_layout_with_planted_links_and_fifos_is_refused(tmp_path: Path, home, canary: Path) -> None:
    """A layout folder whose blob is a symlink to a host file, or a FIFO: not followed, not hung on."""
    cfg, store = home
    layout, info = _layout(tmp_path)
    config = layout / "blobs/sha256" / info["config"][7:]
    config.unlink()
    config.symlink_to(canary / "victim")
    with pytest.raises(InvalidArgument, match="symbolic links"):
        oci_store.load(cfg, store, layout)
    config.unlink()
    os.mkfifo(config)
    with pytest.raises(InvalidArgument, match="not a regular file|missing"):
        oci_store.load(cfg, store, layout)
    nothing_stored(cfg, store)
    canary_intact(canary)
