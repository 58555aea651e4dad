"""Hostile and broken images (issue 11): layer tars that climb out with ``..``, name
absolute paths, write through a symlink they planted, hard-link host files, bring
device nodes or ids outside the workspaces' range, or redirect the overlay through
an xattr; blobs whose digest does not match; truncated and corrupt archives; a full
disk. Each gets a clear error, leaves nothing half-stored (no layer, no image, no
staging) and writes nothing outside the store (canaries the test plants)."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import os
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound, InvalidArgument, PayloadTooLarge, ResourceExhausted
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.oci.pull import pull
from bunshin.runtime.state.store import Store, release_kept
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


BASE_DIFF_ID = "sha256:" + hashlib.sha256(oi.busybox_base().tar_bytes()).hexdigest()


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
        release_kept(cfg.db_path)  # the store this process keeps open holds the mount
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



# ------------------------------------------------------------------ caps (issue 25)

_ZEROS = 1 << 27  # the bombs' repeated member (gzip) or frame (zstd): 128 MiB of zeros


def _compress(kind: str, data: bytes) -> bytes:
    if kind == "gzip":
        return gzip.compress(data, compresslevel=9, mtime=0)
    import zstandard

    return zstandard.ZstdCompressor(level=3).compress(data)


def write_bomb(dest: Path, kind: str, size: int) -> str:
    """A compressed tar of one file of ``size`` zero bytes, as concatenated gzip members
    (zstd frames): the header, then the same 128 MiB of zeros again and again, then the
    rest; the uncompressed stream is never made. Returns the blob's digest."""
    ti = tarfile.TarInfo("zeros")
    ti.size, ti.mode = size, 0o644
    tail = size + (-size % 512) + 1024  # the data, its padding, the end-of-archive blocks
    block = _compress(kind, bytes(_ZEROS))
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in (_compress(kind, ti.tobuf(tarfile.PAX_FORMAT)), *[block] * (tail // _ZEROS),
                     _compress(kind, bytes(tail % _ZEROS))):
            out.write(part)
            h.update(part)
    return "sha256:" + h.hexdigest()


def bomb_layout(dest: Path, kind: str, size: int) -> Path:
    """An OCI layout whose one layer is a bomb (its diff id the sha256 of nothing: the
    cap must stop the unpack long before the digest is known)."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    tmp = blobs / "bomb"
    digest = write_bomb(tmp, kind, size)
    tmp.rename(blobs / digest[7:])
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256().hexdigest()]}}).encode()
    (blobs / hashlib.sha256(config).hexdigest()).write_bytes(config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": "sha256:" + hashlib.sha256(config).hexdigest(), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest,
                                       "size": tmp.parent.joinpath(digest[7:]).stat().st_size}]}).encode()
    (blobs / hashlib.sha256(manifest).hexdigest()).write_bytes(manifest)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json",
         "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(), "size": len(manifest)}]}))
    return dest


@pytest.mark.parametrize(("kind", "size"), [("gzip", 4 << 30), ("zstd", 64 << 30), ("archive", 4 << 30)])
def test_a_decompression_bomb_stops_at_the_size_cap(kind: str, size: int, tmp_path: Path, home) -> None:
    """4 MiB of gzip (deflate's 1:1032) or 2 MiB of zstd that unpack to 4 and 64 GiB:
    refused at the 64 MiB cap by name, nothing kept (also a whole archive that is a bomb,
    decompressed into staging before anything is read)."""
    cfg, store = home
    cfg = dataclasses.replace(cfg, image_max_bytes="64M")
    if kind == "archive":
        path = tmp_path / "img.tar.gz"
        write_bomb(path, "gzip", size)
    else:
        path = bomb_layout(tmp_path / "layout", kind, size)
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) < size >> 9, "a bomb, not data"
    with pytest.raises(PayloadTooLarge, match="image_max_bytes=67108864") as exc:
        oci_store.load(cfg, store, path)
    assert "--max-size" in (exc.value.hint or "") and "BUNSHIN_IMAGE_MAX_BYTES" in (exc.value.hint or "")
    nothing_stored(cfg, store)
    assert oci_store.stored_layers(cfg) == []


def test_a_huge_pax_header_is_refused_before_it_is_read(tmp_path: Path, home) -> None:
    """tarfile reads an extended header whole into memory: one of 2 MiB (a bomb's could be GiBs) is refused."""
    cfg, store = home
    ti = tarfile.TarInfo("x")
    ti.pax_headers = {"comment": "z" * (2 << 20)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(ti)
    with pytest.raises(InvalidArgument, match="extended header"):
        oci_store.load(cfg, store, _raw_layout(tmp_path, buf.getvalue()))
    nothing_stored(cfg, store)


def _raw_layout(tmp_path: Path, tar: bytes) -> Path:
    oi.build_layout(tmp_path / "raw", [_RawLayer(tar)])
    return tmp_path / "raw"


def test_more_layers_than_the_cap_are_refused_before_unpacking(tmp_path: Path, home) -> None:
    cfg, store = home
    layout = tmp_path / "deep"
    oi.build_layout(layout, [oi.Layer().add(f"f{i}", "file", str(i)) for i in range(6)])
    with pytest.raises(PayloadTooLarge, match=r"6 layers, more than the layer cap image_max_layers=5") as exc:
        oci_store.load(dataclasses.replace(cfg, image_max_layers=5), store, layout)
    assert "--max-layers" in (exc.value.hint or "")
    assert oci_store.stored_layers(cfg) == [], "not one layer unpacked"
    nothing_stored(cfg, store)
    assert cfg.image_max_layers == 125, "docker's limit by default"


class _LyingRegistry(http.server.BaseHTTPRequestHandler):
    """A registry v2 on loopback whose one layer blob is 1,000 bytes in its manifest and
    up to 1 GiB of zeros on the wire (skopeo checks the digest only at the end)."""

    protocol_version = "HTTP/1.1"
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}).encode()
    blob = "sha256:" + "1" * 64
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": "sha256:" + hashlib.sha256(config).hexdigest(), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                       "digest": blob, "size": 1000}]}).encode()
    sent = [0]

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, body: bytes, kind: str = "application/octet-stream") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Docker-Content-Digest", "sha256:" + hashlib.sha256(body).hexdigest())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if "/manifests/" in self.path:
            return self._reply(self.manifest, "application/vnd.oci.image.manifest.v1+json")
        if self.path.endswith(self.blob):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"%x\r\n%s\r\n" % (1 << 20, bytes(1 << 20))
            with contextlib.suppress(OSError):
                for _ in range(1024):
                    self.wfile.write(chunk)
                    self.sent[0] += 1 << 20
                self.wfile.write(b"0\r\n\r\n")
            return None
        return self._reply(self.config if "/blobs/" in self.path else b"")  # the config, or /v2/


def test_a_download_longer_than_its_manifest_says_stops_at_the_cap(home) -> None:
    cfg, store = home
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LyingRegistry)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(PayloadTooLarge, match="download .* goes past the image size cap image_max_bytes=67108864"):
            pull(dataclasses.replace(cfg, image_max_bytes="64M"), store, f"127.0.0.1:{srv.server_address[1]}/x/y:1")
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()
    assert _LyingRegistry.sent[0] < 512 << 20, "skopeo was stopped long before the 1 GiB"
    nothing_stored(cfg, store)
