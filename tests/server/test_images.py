"""Images over HTTP: a stored image by reference for workspaces, groups and rollouts;
a host folder (absolute, relative, or a name that is not a reference) never is one."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound, InvalidArgument
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc

from ..runtime import oci_images as oi
from .conftest import Served

pytestmark = [pytest.mark.integration, pytest.mark.criu]

CONFIG = {"Env": ["FOO=from-image", "PATH=/usr/bin:/bin"], "WorkingDir": "/work", "Cmd": ["sleep", "1001"]}


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("served-image")
    layers = [oi.busybox_base(), oi.Layer().add("work", "dir").add("work/hello", "file", "from the image\n")]
    oi.build_layout(root / "layout", layers, config=CONFIG)
    return oi.docker_archive(root / "layout", root / "img.tar", "served/img:v1")


@pytest.fixture
def stored(archive: Path, no_leaks: Config):
    with Store.open(no_leaks.db_path) as store:
        (rec,) = oci_store.load(no_leaks, store, archive)
    yield rec
    with Store.open(no_leaks.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(no_leaks, store)


def test_a_workspace_and_its_fork_from_a_stored_image(served: Served, stored) -> None:
    with served.client() as c:
        ws = c.create("served/img:v1", memory="256M")
        assert ws.info.image == stored.id  # the reference, resolved on the host
        r = ws.exec("pwd; echo $FOO; cat hello", timeout=30)
        assert r.stdout == "/work\nfrom-image\nfrom the image\n"
        (clone,) = ws.fork(1)
        assert clone.exec("cat /work/hello", timeout=30).stdout == "from the image\n"
        clone.remove()
        ws.remove()


def test_a_group_and_a_rollout_task_name_the_image(served: Served, stored) -> None:
    with served.client() as c:
        grp = c.group(key="img-group", n=2, image="served/img:v1")
        outs = {t.call("bash", {"command": "cat /work/hello"}).output for t in grp.trajectories}
        assert outs == {"from the image\n"}
        grp.remove()
        task = {"id": "img-task", "image": "served/img:v1", "setup": ["echo set > /work/s"], "reward": "echo 1"}
        grp = c.group(key="img-task-group", n=1, task=task)
        (t,) = grp.trajectories
        assert t.call("bash", {"command": "cat /work/s /work/hello"}).output == "set\nfrom the image\n"
        assert t.reward().reward == 1.0
        grp.remove()


def test_host_folders_are_never_images_over_http(served: Served, no_leaks: Config, tmp_path, monkeypatch) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "canary").write_text("a host folder")
    monkeypatch.chdir(tmp_path)  # a relative name that is a folder where the server runs
    with served.client() as c:
        for bad in (str(rootfs), "./rootfs", "../x", "~root"):
            with pytest.raises(InvalidArgument, match="not an image reference"):
                c.create(bad, memory="256M")
        with pytest.raises(ImageNotFound):  # looks like a reference: not a folder, an unknown image
            c.create("rootfs", memory="256M")
        with pytest.raises(InvalidArgument, match="not an image reference"):
            c.group(key="folder-group", n=1, image=str(rootfs))
        with pytest.raises(InvalidArgument, match="not an image reference"):
            c.group(key="folder-task", n=1, task={"id": "t", "image": "./rootfs"})
        assert c.list() == []
    r = httpx.post(f"{served.url}/v1/rollouts", headers={"Authorization": f"Bearer {served.token}"},
                   json={"task": {"id": "t", "image": str(rootfs)}, "n": 1,
                         "policy": {"base_url": "http://127.0.0.1:9/v1", "model": "m"}})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    assert "not an image reference" in r.json()["message"]
