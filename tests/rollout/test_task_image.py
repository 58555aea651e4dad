"""Task specs with ``image: REF`` (issue 11): the image is pulled on first use (a loopback
registry serves it) and the task root is keyed by (image digest, setup)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound
from bunshin.rollout.task import parse_task, resolve_image
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from tests.runtime import oci_images as oi

pytestmark = pytest.mark.integration


def test_image_task_pulls_on_first_use_and_keys_its_root_by_digest(tmp_path: Path) -> None:
    cfg = Config.for_home(tmp_path / "home")
    layout_a, layout_b = tmp_path / "a", tmp_path / "b"
    a = oi.build_layout(layout_a, [oi.busybox_base(), oi.Layer().add("v", "file", "1\n")])
    b = oi.build_layout(layout_b, [oi.busybox_base(), oi.Layer().add("v", "file", "2\n")])
    (tmp_path / "reg").mkdir()
    with oi.Registry(tmp_path / "reg") as reg:
        ref = reg.push(layout_a, "tasks/env:latest")
        task = parse_task({"id": "t1", "image": ref, "setup": ["echo hi > /tmp/x"]})
        first = resolve_image(task, cfg)
        assert first == a["config"]
        with Store.open(cfg.db_path) as store:
            assert oci_store.find(store, ref).id == first, "pulled into the store"
        assert resolve_image(task, cfg) == first  # stored now: no second pull
        key = task.root_key(first)
        assert parse_task({"id": "t2", "image": ref, "setup": ["echo hi > /tmp/x"]}).root_key(first) == key, \
            "same image digest and setup: the same root"
        assert parse_task({"id": "t1", "image": ref, "setup": ["echo other"]}).root_key(first) != key
        reg.push(layout_b, "tasks/env:latest")  # the tag moves to a new image: a new root
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, ref)
        second = resolve_image(task, cfg)
        assert second == b["config"] and task.root_key(second) != key
    with pytest.raises(ImageNotFound, match="neither a folder nor a stored image"):
        resolve_image(parse_task({"id": "t3", "image": "not/pulled:1"}), cfg)
    assert resolve_image(parse_task({"id": "t4"}), cfg) == "host"


def test_an_image_id_is_never_a_folder_even_when_one_of_that_name_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The task and the runtime decide 'folder or stored image' by one rule: a folder in the
    working directory named like a full image id does not stand in for the image."""
    cfg = Config.for_home(tmp_path / "home")
    image_id = "sha256:" + "ab" * 32
    monkeypatch.chdir(tmp_path)
    (tmp_path / image_id).mkdir()
    with pytest.raises(ImageNotFound, match="neither a folder nor a stored image"):
        resolve_image(parse_task({"id": "t", "image": image_id}), cfg)
    folder = tmp_path / "rootfs"
    folder.mkdir()
    assert resolve_image(parse_task({"id": "t", "image": str(folder)}), cfg) == str(folder)
