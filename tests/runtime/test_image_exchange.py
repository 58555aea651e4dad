"""Images moved between two homes by digest (runtime/oci/exchange, layer_tar): the
manifest first, then only the layers the receiver lacks, each layer's tar made from the
unpacked tree (the same bytes every time, and again after the move) and checked against
its signed entry; a tampered, truncated, over-long or hostile stream is refused and leaves
nothing; a manifest or entry not signed with the receiver's key is refused."""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound, InvalidArgument, PayloadTooLarge, Unauthorized
from bunshin.runtime.oci import exchange, layer_tar
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.keys import home_key
from bunshin.runtime.state.store import Store

from . import oci_images as oi
from .test_oci_image import CONFIG, image_layers

NAME = "test/xchg:v1"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("xchg")
    layers = image_layers()
    oi.build_layout(root / "full", layers, config=CONFIG)
    oi.build_layout(root / "lower", layers[:2], config={"Cmd": ["sh"]})  # the same first two layers
    return {"full": root / "full", "lower": root / "lower"}


def _home(path: Path, key: bytes | None) -> Config:
    cfg = Config.for_home(path)
    cfg.home.mkdir(parents=True, exist_ok=True)
    if key is not None:
        fd = os.open(cfg.snapshot_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, key)
        os.close(fd)
    return cfg


@pytest.fixture
def pair(tmp_path: Path, layouts):
    """A holder home with the image and an empty receiver sharing its key."""
    key = os.urandom(32)
    a, b = _home(tmp_path / "a", key), _home(tmp_path / "b", key)
    with Store.open(a.db_path) as sa, Store.open(b.db_path) as sb:
        (rec,) = oci_store.load(a, sa, layouts["full"], tags=[NAME])
        yield a, sa, b, sb, rec


def _tree(root: Path) -> list[tuple]:
    """Everything overlayfs sees of a layer folder: names, types, modes, owners, times
    (a whiteout's is the time it was made: overlayfs ignores it), contents, link targets,
    device numbers, the opaque xattr, which names share an inode."""
    out: list[tuple] = []
    inodes: dict[int, str] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted([*dirs, *files]):
            p = Path(dirpath, name)
            st = p.lstat()
            rel = str(p.relative_to(root))
            extra: object = None
            if stat.S_ISREG(st.st_mode):
                extra = (p.read_bytes(), inodes.setdefault(st.st_ino, rel))
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                extra = os.getxattr(p, "trusted.overlay.opaque") if "trusted.overlay.opaque" in os.listxattr(p) else None
            whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # its time means nothing (not in the tar)
            out.append((rel, st.st_mode, st.st_uid, st.st_gid, None if whiteout else int(st.st_mtime), st.st_rdev,
                        extra))
    return out


def _send(a, sa, b, sb, image_id, entry, data: bytes | None = None):
    e = exchange.check_entry(entry)
    body = data if data is not None else b"".join(layer_tar.chunks(a, e.diff_id))
    return exchange.import_layer(b, sb, image_id, e, io.BytesIO(body))


def _staging_empty(cfg: Config) -> bool:
    return not cfg.paths.image_staging.exists() or not any(cfg.paths.image_staging.iterdir())


def test_round_trip_gives_the_same_layers_and_the_same_tar_bytes(pair) -> None:
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, NAME)
    first = [b"".join(layer_tar.chunks(a, d)) for d in rec.layers]
    assert first == [b"".join(layer_tar.chunks(a, d)) for d in rec.layers], "the same bytes every time"
    got, missing = exchange.import_image(b, sb, doc)
    assert got.id == rec.id and missing == list(rec.layers) and f"docker.io/{NAME}" in got.names
    assert oci_store.complete(b, sb, rec.id) is None, "recorded, not complete yet"
    for entry in doc["layers"]:
        done = _send(a, sa, b, sb, rec.id, entry)
        assert not done.skipped and done.bytes_read == entry["size"]
    assert oci_store.complete(b, sb, rec.id) is not None
    assert oci_store.find(sb, NAME).id == rec.id and oci_store.find(sb, NAME).config == rec.config
    for d in rec.layers:
        assert _tree(b.paths.image_layer(d)) == _tree(a.paths.image_layer(d))
    # the whiteout, the opaque folder, the hard link, uid 1000 and setuid all made it
    top = b.paths.image_layer(rec.layers[-1])
    assert stat.S_ISCHR((top / "data" / "gone").lstat().st_mode)
    assert os.getxattr(top / "opq", "trusted.overlay.opaque") == b"y"
    assert (top / "work").stat().st_uid == b.id_base + 1000 and (top / "setuid").stat().st_mode & 0o7777 == 0o4755
    mid = b.paths.image_layer(rec.layers[1])
    assert (mid / "data" / "keep").stat().st_ino == (mid / "data" / "keep2").stat().st_ino
    # exported again on the receiver: the same tar, so a third host can take it from there
    assert [b"".join(layer_tar.chunks(b, d)) for d in rec.layers] == first
    assert [layer_tar.describe(b, sb, d).digest for d in rec.layers] == [e["digest"] for e in doc["layers"]]
    assert _staging_empty(b)


def test_only_the_layers_the_receiver_lacks_are_asked_for(pair, layouts) -> None:
    a, sa, b, sb, rec = pair
    (lower,) = oci_store.load(b, sb, layouts["lower"])
    assert list(lower.layers) == list(rec.layers[:2])
    doc = exchange.manifest(a, sa, rec.id)
    _, missing = exchange.import_image(b, sb, doc)
    assert missing == [rec.layers[2]], "the two shared layers are not sent"
    # a layer sent anyway is skipped without a byte read
    done = exchange.import_layer(b, sb, rec.id, exchange.check_entry(doc["layers"][0]), io.BytesIO(b"junk"))
    assert done.skipped and done.bytes_read == 0
    _send(a, sa, b, sb, rec.id, doc["layers"][2])
    assert exchange.import_image(b, sb, doc)[1] == [], "nothing left to send"


@pytest.mark.parametrize("damage", ["flip", "truncate", "longer", "empty"])
def test_a_damaged_stream_is_refused_and_leaves_nothing(pair, damage) -> None:
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    exchange.import_image(b, sb, doc)
    entry = doc["layers"][1]
    good = b"".join(layer_tar.chunks(a, entry["diff_id"]))
    i = good.index(b"kept\n")
    bad = {"flip": good[:i] + b"K" + good[i + 1:], "truncate": good[: len(good) // 2],
           "longer": good + b"\0" * 512, "empty": b""}[damage]
    with pytest.raises(InvalidArgument) as e:
        _send(a, sa, b, sb, rec.id, entry, bad)
    assert e.value.hint
    assert not b.paths.image_layer(entry["diff_id"]).exists() and _staging_empty(b)
    assert oci_store.stored_layer_size(b, sb, entry["diff_id"]) is None
    _send(a, sa, b, sb, rec.id, entry)  # the intact stream still goes in afterwards
    assert oci_store.stored_layer_size(b, sb, entry["diff_id"]) is not None


def test_a_hostile_tar_under_a_valid_signature_is_still_unpacked_safely(pair, tmp_path: Path) -> None:
    """Whoever holds the key is trusted to sign, not to write outside the layer: the tar's
    members go through unpack's checks all the same."""
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    exchange.import_image(b, sb, doc)
    canary = tmp_path / "canary"
    rel = os.path.relpath(canary, b.paths.image_staging / "x")
    for member in (rel, "/etc/bunshin-canary"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            ti = tarfile.TarInfo(member)
            ti.size = 3
            t.addfile(ti, io.BytesIO(b"pwn"))
        data = buf.getvalue()
        import hashlib

        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        diff_id = rec.layers[0]
        key = home_key(b, create=False)
        assert key is not None
        entry = {"diff_id": diff_id, "digest": digest, "size": len(data),
                 "mac": exchange.layer_mac(key, diff_id, digest, len(data))}
        with pytest.raises(InvalidArgument, match="absolute path|goes up"):
            _send(a, sa, b, sb, rec.id, entry, data)
        assert not canary.exists() and not Path("/etc/bunshin-canary").exists()
        assert not b.paths.image_layer(diff_id).exists() and _staging_empty(b)


def test_what_the_receivers_key_did_not_sign_is_refused(pair, tmp_path: Path) -> None:
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    for change in ({"names": ["docker.io/evil/img:v1"]}, {"size_bytes": 1}, {"mac": "hmac-sha256:" + "0" * 64}):
        bad = {**copy.deepcopy(doc), **change}
        with pytest.raises(Unauthorized) as e:
            exchange.import_image(b, sb, bad)
        assert "snapshot.key" in (e.value.hint or "")
    with pytest.raises(ImageNotFound):
        oci_store.find(sb, rec.id)
    # a layer entry whose size or digest was changed after it was signed
    exchange.import_image(b, sb, doc)
    entry = {**doc["layers"][2], "size": doc["layers"][2]["size"] + 512}
    with pytest.raises(Unauthorized):
        _send(a, sa, b, sb, rec.id, entry)
    # a home with another key (not of this cluster) takes nothing
    other = _home(tmp_path / "other", os.urandom(32))
    with Store.open(other.db_path) as so:
        with pytest.raises(Unauthorized):
            exchange.import_image(other, so, doc)
    # nor does a home with no key at all
    keyless = _home(tmp_path / "keyless", None)
    with Store.open(keyless.db_path) as sk:
        with pytest.raises(Unauthorized):
            exchange.import_image(keyless, sk, doc)
    shutil.rmtree(other.home)


def test_a_layer_of_no_image_recorded_here_is_refused(pair) -> None:
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    with pytest.raises(ImageNotFound, match="manifest first"):
        _send(a, sa, b, sb, rec.id, doc["layers"][0])
    assert not b.paths.image_layer(rec.layers[0]).exists()


def test_a_manifest_whose_layers_are_not_its_configs_is_refused(pair) -> None:
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    doc["layers"] = doc["layers"][:2]
    key = home_key(a, create=False)
    from bunshin.runtime.state.keys import mac

    doc["mac"] = mac(key, doc)
    with pytest.raises(InvalidArgument, match="diff ids its config lists"):
        exchange.import_image(b, sb, doc)


def test_a_receivers_caps_hold_for_a_moved_image(pair) -> None:
    """The receiver's own caps: more layers than it takes refused with the manifest; a layer
    whose tar passes its size cap stopped while it is unpacked (staging removed)."""
    a, sa, b, sb, rec = pair
    doc = exchange.manifest(a, sa, rec.id)
    with pytest.raises(PayloadTooLarge, match=f"{len(rec.layers)} layers, more than the layer cap"):
        exchange.import_image(dataclasses.replace(b, image_max_layers=len(rec.layers) - 1), sb, doc)
    with pytest.raises(ImageNotFound):
        oci_store.find(sb, rec.id)
    exchange.import_image(b, sb, doc)
    big = max(doc["layers"], key=lambda e: e["size"])
    small = dataclasses.replace(b, image_max_bytes=big["size"] // 2)
    with pytest.raises(PayloadTooLarge, match=f"image_max_bytes={big['size'] // 2}"):
        _send(a, sa, small, sb, rec.id, big)
    assert oci_store.stored_layer_size(b, sb, big["diff_id"]) is None and _staging_empty(b)
