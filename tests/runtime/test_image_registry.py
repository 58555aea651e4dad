"""Pulls from a real registry (issue 11): Debian's docker-registry on loopback (plain
HTTP), the test image pushed by skopeo; pulled by tag and by pinned digest, sharing
its layers with the same image loaded as a ``docker save`` archive and as an OCI
layout; a private registry's credentials from the docker config file or the
environment; unknown references, wrong digests and an unreachable registry get
clear errors and store nothing; ``Workspace.create`` pulls on first use."""

from __future__ import annotations

import base64
import json
import warnings
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound, Unreachable
from bunshin.runtime.oci import pull as oci_pull
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.oci.refs import Reference
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace

from . import oci_images as oi

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("registry")
    layout = root / "layout"
    info = oi.build_layout(layout, [oi.busybox_base(), oi.Layer().add("hello", "file", "from the registry\n")],
                           config={"Cmd": ["sleep", "1004"], "Env": ["WHERE=registry"]})
    (root / "reg").mkdir()
    with oi.Registry(root / "reg") as reg:
        ref = reg.push(layout, "team/env:v1")
        yield {"registry": reg, "ref": ref, "layout": layout, "info": info,
               "docker": oi.docker_archive(layout, root / "docker.tar", "team/env:v1")}


@pytest.fixture
def home(tmp_path: Path):
    cfg = Config.for_home(tmp_path / "home")
    with Store.open(cfg.db_path) as store:
        yield cfg, store


def test_pulled_saved_and_layout_loads_share_layers(served, home) -> None:
    cfg, store = home
    lines: list[str] = []
    rec = oci_pull.pull(cfg, store, served["ref"], progress=lines.append)
    assert rec.id == served["info"]["config"] and list(rec.layers) == served["info"]["diff_ids"]
    assert served["ref"] + "" in rec.names and rec.digests
    assert any("blob" in line.lower() for line in lines), lines  # skopeo's progress, passed on
    (saved,) = oci_store.load(cfg, store, served["docker"])
    (layout,) = oci_store.load(cfg, store, served["layout"])
    assert saved.id == layout.id == rec.id
    assert oci_store.stored_layers(cfg) == sorted(rec.layers), "two layers, stored once for three sources"
    assert oci_store.find(store, served["ref"]).id == rec.id
    assert list(cfg.paths.image_staging.iterdir()) == [], "the pull's staging folder is gone"
    again: list[str] = []
    assert oci_pull.pull(cfg, store, served["ref"], progress=again.append).id == rec.id
    assert any("already stored" in line for line in again) and not any("blob" in line.lower() for line in again), \
        "a warm pull fetches the manifest only"
    import shutil

    shutil.rmtree(cfg.paths.image_layer(rec.layers[-1]))  # a layer gone: the pull fetches and unpacks it
    again.clear()
    assert oci_pull.pull(cfg, store, served["ref"], progress=again.append).id == rec.id
    assert any("unpacking" in line for line in again), again
    assert oci_store.stored_layers(cfg) == sorted(rec.layers)


def test_pull_pinned_by_digest(served, home) -> None:
    cfg, store = home
    digest = served["info"]["manifest"]
    rec = oci_pull.pull(cfg, store, served["ref"].split(":v1")[0] + "@" + digest)
    assert digest in rec.digests and rec.id == served["info"]["config"]
    assert oci_store.find(store, served["ref"].split(":v1")[0] + "@" + digest).id == rec.id
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ImageNotFound) as exc:
        oci_pull.pull(cfg, Store.open(cfg.db_path), served["ref"].split(":v1")[0] + "@" + wrong)
    assert exc.value.hint


def test_pull_pinned_to_a_multi_arch_index(home, tmp_path: Path) -> None:
    """A pin naming an index: skopeo takes this machine's manifest from it; the index hashes
    to the pin and lists that manifest."""
    cfg, store = home
    info = oi.build_layout(tmp_path / "multi", [oi.busybox_base()], multi_arch=True)
    (tmp_path / "reg").mkdir()
    with oi.Registry(tmp_path / "reg") as reg:
        ref = reg.push(tmp_path / "multi", "multi/arch:1", "--all")
        rec = oci_pull.pull(cfg, store, f"{ref.rsplit(':', 1)[0]}@{info['index']}")
        assert rec.id == info["config"] and info["index"] in rec.digests
        assert oci_pull.pull(cfg, store, ref).id == rec.id  # by tag: the index, stored already
    (loaded,) = oci_store.load(cfg, store, tmp_path / "multi")  # the layout's nested index, read directly
    assert loaded.id == rec.id


def test_unknown_and_unreachable(served, home) -> None:
    cfg, store = home
    with pytest.raises(ImageNotFound, match="no image"):
        oci_pull.pull(cfg, store, served["registry"].host + "/team/nosuch:v1")
    with pytest.raises(Unreachable, match="cannot reach") as exc:
        oci_pull.pull(cfg, store, "127.0.0.1:1/team/env:v1")
    assert exc.value.hint
    assert oci_store.list_images(store) == [] and oci_store.stored_layers(cfg) == []
    assert list(cfg.paths.image_staging.iterdir()) == []


def test_tls_is_skipped_for_loopback_only() -> None:
    loop = oci_pull.skopeo_argv(Reference.parse("127.0.0.1:5000/a/b:1"), Path("/x"), None)
    assert "--src-tls-verify=false" in loop
    for ref in ("registry.example.com/a/b:1", "docker.io/library/python:3", "10.0.0.1:5000/a:1"):
        assert not any("tls-verify" in a for a in oci_pull.skopeo_argv(Reference.parse(ref), Path("/x"), None))


def _htpasswd(path: Path, user: str, password: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        crypt = pytest.importorskip("crypt", reason="needs the crypt module for a bcrypt htpasswd")
    path.write_text(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")


def test_private_registry_credentials(served, home, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, store = home
    _htpasswd(tmp_path / "htpasswd", "alice", "s3cret")
    (tmp_path / "reg").mkdir()
    with oi.Registry(tmp_path / "reg", htpasswd=tmp_path / "htpasswd") as reg:
        ref = reg.push(served["layout"], "private/env:v1", "--dest-creds", "alice:s3cret")
        monkeypatch.setenv("HOME", str(tmp_path))  # no docker config file: refused
        monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
        monkeypatch.delenv("DOCKER_CONFIG", raising=False)
        with pytest.raises(ImageNotFound, match="refuses"):
            oci_pull.pull(cfg, store, ref)
        monkeypatch.setenv("BUNSHIN_REGISTRY_USERNAME", "alice")
        monkeypatch.setenv("BUNSHIN_REGISTRY_PASSWORD", "s3cret")
        assert oci_pull.pull(cfg, store, ref).id == served["info"]["config"]
        oci_store.remove(store, ref)
        monkeypatch.delenv("BUNSHIN_REGISTRY_USERNAME")
        (tmp_path / ".docker").mkdir()
        auth = base64.b64encode(b"alice:s3cret").decode()
        (tmp_path / ".docker" / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": auth}}}))
        assert oci_pull.pull(cfg, store, ref).id == served["info"]["config"]


def test_create_pulls_on_first_use(served, cfg: Config, no_leaks) -> None:
    try:
        with Workspace.create(served["ref"], memory="256M", config=cfg) as ws:
            assert ws.exec("cat /hello; echo $WHERE").stdout == "from the registry\nregistry\n"
            assert "sleep 1004" in ws.exec("ps -o args").stdout
    finally:
        with Store.open(cfg.db_path) as store:
            for rec in oci_store.list_images(store):
                if served["ref"] in rec.names:
                    oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)
