"""Edited CRIU images are refused before ``criu restore`` (which runs as host root) sees them."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime.memfile import criu_images
from bunshin.runtime.snapshot import image_policy
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]


@pytest.fixture
def images(no_leaks, tmp_path):
    """A copy of the images of a real snapshot of a workspace running a child process."""
    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        ws.exec("sleep 600 >/dev/null 2>&1 &")
        snap = ws.snapshot()
        try:
            out = tmp_path / "images"
            shutil.copytree(snap.record.images, out)
            yield out
        finally:
            snap.remove()
    finally:
        ws.remove()


def _edit(path: Path, change) -> None:
    img = criu_images.load(path)
    change(img)
    criu_images.save(img, path)


def test_bunshins_own_images_pass(images, no_leaks):
    image_policy.check(images, no_leaks)


def test_a_user_namespace_mapped_onto_host_root_is_refused(images, no_leaks):
    userns = next(images.glob("userns-*.img"))

    def to_root(img):
        for entry in img["entries"]:
            for key in ("uid_map", "gid_map"):
                entry[key] = [{"first": 0, "lower_first": 0, "count": 65536}]

    _edit(userns, to_root)
    with pytest.raises(InvalidArgument, match="map the user namespace"):
        image_policy.check(images, no_leaks)


def test_tasks_outside_any_user_namespace_are_refused(images, no_leaks):
    next(images.glob("userns-*.img")).unlink()
    with pytest.raises(InvalidArgument, match="outside a user namespace"):
        image_policy.check(images, no_leaks)


def test_a_mount_of_the_host_disk_is_refused(images, no_leaks):
    mounts = next(images.glob("mountpoints-*.img"))

    def add_disk(img):
        proc = next(e for e in img["entries"] if e["mountpoint"] == "/proc")
        disk = copy.deepcopy(proc)
        disk.update(fstype=0, mountpoint="/mnt", source="/dev/vda", mnt_id=9999, root="/")
        img["entries"].append(disk)

    _edit(mounts, add_disk)
    with pytest.raises(InvalidArgument, match="mount a filesystem"):
        image_policy.check(images, no_leaks)


def test_a_task_without_the_seccomp_filter_is_refused(images, no_leaks):
    pids = [int(e["pid"]) for e in criu_images.load(images / "pstree.img")["entries"]]
    assert len(pids) >= 2  # the agent and the sleep

    def drop(img):
        img["entries"][0]["thread_core"].pop("seccomp_mode", None)
        img["entries"][0]["thread_core"].pop("seccomp_filter", None)

    _edit(images / f"core-{pids[-1]}.img", drop)
    with pytest.raises(InvalidArgument, match="seccomp"):
        image_policy.check(images, no_leaks)


def test_garbage_images_are_a_clear_error(images, no_leaks):
    (images / "pstree.img").write_bytes(b"\x00garbage")
    with pytest.raises(InvalidArgument, match="damaged|seccomp"):
        image_policy.check(images, no_leaks)


def test_load_refuses_edited_images_even_when_trusted(no_leaks, tmp_path):
    from bunshin.runtime import snapshot as rsnap
    from bunshin.runtime.state.store import Store
    from bunshin.workspace import Snapshot

    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        snap = ws.snapshot()
        folder = snap.save(tmp_path / "saved")
        snap.remove()
    finally:
        ws.remove()

    def to_root(img):
        for entry in img["entries"]:
            entry["uid_map"] = entry["gid_map"] = [{"first": 0, "lower_first": 0, "count": 65536}]

    _edit(next((folder / "images").glob("userns-*.img")), to_root)
    with pytest.raises(InvalidArgument, match="map the user namespace"):
        Snapshot.load(folder, config=no_leaks, trust=True)
    with Store.open(no_leaks.db_path) as store:
        assert rsnap.list_all(store) == []  # nothing recorded, nothing left on tmpfs (no_leaks)
