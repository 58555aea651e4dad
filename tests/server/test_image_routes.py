"""Images between two real servers over loopback HTTP (issue 14): the manifest first, then
only the layers the target lacks, streamed from one server's answer into the other's
request; the token, ``--max-upload``, a changed manifest and a tampered stream refused
with bunshin's errors, leaving no layer and no staging behind."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from bunshin.client import Client
from bunshin.client.images import copy_image
from bunshin.config import Config
from bunshin.errors import ImageNotFound, InvalidArgument, PayloadTooLarge, Unauthorized
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.server.admission import Limits
from bunshin.server.thread import serve_in_thread
from tests.conftest import drop_state_tmpfs, leftovers
from tests.runtime import oci_images as oi
from tests.runtime.test_oci_image import CONFIG, image_layers

from .conftest import TOKEN

NAME = "test/routes:v1"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("routes")
    layers = image_layers()
    oi.build_layout(root / "full", layers, config=CONFIG)
    oi.build_layout(root / "lower", layers[:2], config={"Cmd": ["sh"]})
    return {"full": root / "full", "lower": root / "lower"}


def _home(path: Path, key: bytes) -> Config:
    cfg = Config.for_home(path)
    cfg.home.mkdir(parents=True)
    fd = os.open(cfg.snapshot_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key)
    os.close(fd)
    return cfg


@pytest.fixture
def hosts(tmp_path: Path, layouts) -> Iterator[tuple[Client, Client, Config, Config, str]]:
    """Two servers sharing a snapshot key; the first holds the image. The target's uploads
    are capped at 64 KiB (the test image's top layer fits, its base does not)."""
    key = os.urandom(32)
    a, b = _home(tmp_path / "a", key), _home(tmp_path / "b", key)
    with Store.open(a.db_path) as sa:
        (rec,) = oci_store.load(a, sa, layouts["full"], tags=[NAME])
    with ExitStack() as stack:
        ua = stack.enter_context(serve_in_thread(a, TOKEN))
        ub = stack.enter_context(serve_in_thread(b, TOKEN, limits=Limits(max_upload=64 << 10)))
        ca, cb = stack.enter_context(Client(ua, token=TOKEN)), stack.enter_context(Client(ub, token=TOKEN))
        yield ca, cb, a, b, rec.id
    for cfg in (a, b):
        assert not any(leftovers(cfg).values()), leftovers(cfg)
        drop_state_tmpfs(cfg)


def _staging_empty(cfg: Config) -> bool:
    return not cfg.paths.image_staging.exists() or not any(cfg.paths.image_staging.iterdir())


def test_an_image_moves_with_only_the_layers_the_target_lacks(hosts, layouts) -> None:
    ca, cb, a, b, image_id = hosts
    with Store.open(b.db_path) as sb:
        oci_store.load(b, sb, layouts["lower"])  # the target holds the two lower layers already
    assert not cb.images.holds(NAME) and ca.images.holds(NAME)
    doc = ca.images.manifest(NAME)
    sizes = {e["diff_id"]: e["size"] for e in doc["layers"]}
    ca_layers = ca.images.get(image_id).layers
    # the base layer (busybox) is over the target's 64 KiB cap: were it sent, it would be refused
    assert sizes[ca_layers[0]] > 64 << 10 > sizes[ca_layers[2]]
    moved = copy_image(ca.images, cb.images, NAME)
    assert moved.layers_sent == [ca_layers[2]] and moved.layers_skipped == ca_layers[:2]
    assert moved.bytes == sizes[ca_layers[2]]
    got = cb.images.get(NAME)
    assert got.id == image_id and got.complete and f"docker.io/{NAME}" in got.names
    assert cb.images.holds(image_id)
    again = copy_image(ca.images, cb.images, image_id)
    assert again.layers_sent == [] and again.bytes == 0, "a second move sends nothing"
    # HEAD answers whether a host holds it whole
    assert httpx.head(f"{cb.url}/v1/images/{image_id}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert _staging_empty(b)


def test_an_upload_over_max_upload_is_refused_and_the_image_stays_incomplete(hosts) -> None:
    ca, cb, a, b, image_id = hosts
    with pytest.raises(PayloadTooLarge) as e:
        copy_image(ca.images, cb.images, image_id)  # the base layer is first, and over the cap
    assert "--max-upload" in (e.value.hint or "")
    got = cb.images.get(image_id)
    assert not got.complete and len(got.missing) == 3, "recorded, no layer taken"
    assert not cb.images.holds(image_id) and _staging_empty(b)
    r = httpx.head(f"{cb.url}/v1/images/{image_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404


def test_a_tampered_stream_over_http_is_refused_and_leaves_nothing(hosts) -> None:
    ca, cb, a, b, image_id = hosts
    doc = ca.images.manifest(image_id)
    cb.images.put_manifest(doc)
    top = doc["layers"][2]
    data = b"".join(ca.images.layer(image_id, top["diff_id"]))
    assert len(data) == top["size"]
    i = data.index(b"up\n")
    bad = data[:i] + b"UP\n" + data[i + 3:]
    with pytest.raises(InvalidArgument) as e:
        cb.images.put_layer(image_id, top, iter([bad]))
    assert e.value.hint and top["diff_id"] in cb.images.get(image_id).missing
    assert not b.paths.image_layer(top["diff_id"]).exists() and _staging_empty(b)
    # a stream cut short: refused the same
    with pytest.raises(InvalidArgument):
        cb.images.put_layer(image_id, top, iter([data[:1024]]))
    assert _staging_empty(b)
    # the sender dies mid-stream (the head's source host went away): the target drops what it had
    # It goes away only once the target is unpacking (its staging folder holds the layer's):
    # a sender that left before the target even began would leave the check below racing the
    # target's start.
    def dies() -> Iterator[bytes]:
        yield data[:4096]
        began = time.monotonic() + 30
        while _staging_empty(b) and time.monotonic() < began:
            time.sleep(0.02)
        assert not _staging_empty(b), "the target never began unpacking the layer"
        raise ConnectionResetError("the source host went away")

    with pytest.raises(ConnectionResetError):
        cb.images.put_layer(image_id, top, dies())
    deadline = time.monotonic() + 30
    while not _staging_empty(b) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _staging_empty(b) and not b.paths.image_layer(top["diff_id"]).exists()
    assert cb.images.put_layer(image_id, top, iter([data])).bytes_read == len(data)


def test_a_changed_manifest_or_entry_is_refused(hosts) -> None:
    ca, cb, a, b, image_id = hosts
    doc = ca.images.manifest(image_id)
    bad = copy.deepcopy(doc)
    bad["names"] = ["docker.io/library/python:3"]  # an image passed off under another name
    with pytest.raises(Unauthorized, match="not signed"):
        cb.images.put_manifest(bad)
    with pytest.raises(ImageNotFound):
        cb.images.get(image_id)
    cb.images.put_manifest(doc)
    entry = {**doc["layers"][2], "digest": "sha256:" + "0" * 64}
    with pytest.raises(Unauthorized):
        cb.images.put_layer(image_id, entry, iter([b"x" * entry["size"]]))
    with pytest.raises(InvalidArgument, match="not that of image"):
        cb.request("PUT", f"/v1/images/sha256:{'1' * 64}", json=doc)


def test_image_routes_need_the_token_and_name_what_is_missing(hosts) -> None:
    ca, cb, a, b, image_id = hosts
    for method, path in (("GET", "/v1/images"), ("GET", f"/v1/images/{image_id}/manifest"),
                         ("PUT", f"/v1/images/{image_id}"), ("GET", f"/v1/images/{image_id}/layers/{image_id}")):
        r = httpx.request(method, f"{ca.url}{path}")
        assert r.status_code == 401, (method, path)
    with pytest.raises(ImageNotFound) as e:
        cb.images.manifest(NAME)
    assert e.value.hint
    with pytest.raises(ImageNotFound, match="no layer"):
        list(ca.images.layer(image_id, "sha256:" + "2" * 64))
    assert [i.id for i in ca.images.list()] == [image_id] and cb.images.list() == []
