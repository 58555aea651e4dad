"""The rollout test's task on an OCI image held by one host (busybox, the host's bash,
Debian's python3, a small top layer), and a second image of its two lower layers for
another host: the group's other host then lacks only the two upper layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bunshin.config import Config
from bunshin.rollout.task import TaskSpec
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from tests.rollout.test_integration import TASK
from tests.runtime import oci_images as oi

NAME = "test/cluster-img:v1"


def layouts(root: Path) -> tuple[Path, Path]:
    """The full image's layout and the one of its two lower layers."""
    py = oi.python_layer()
    py.compress = "none"  # gzip of the standard library costs seconds here, and tells nothing
    layers = [oi.busybox_base(), oi.binaries_layer("/bin/bash"), py, oi.Layer().add("srv", "dir").add(
        "srv/marker", "file", "from the image\n")]
    oi.build_layout(root / "full", layers)
    oi.build_layout(root / "lower", layers[:2])
    return root / "full", root / "lower"


def task() -> TaskSpec:
    return TASK.model_copy(update={"image": NAME})


@contextmanager
def placed(root: Path, full_on: Config, lower_on: Config | None) -> Iterator[dict[str, str]]:
    """The full image on one home, its lower layers on another (if given). Yields the
    homes' image ids; ``remove_images`` removes them (and what was moved meanwhile)."""
    full, lower = layouts(root)
    ids = {}
    for cfg, layout, tags in ((full_on, full, [NAME]), (lower_on, lower, [])):
        if cfg is None:
            continue
        with Store.open(cfg.db_path) as store:
            (rec,) = oci_store.load(cfg, store, layout, tags=tags)
            ids[str(cfg.home)] = rec.id
    yield ids


def remove_images(*cfgs: Config) -> None:
    for cfg in cfgs:
        if not cfg.db_path.exists():
            continue
        with Store.open(cfg.db_path) as store:
            for rec in oci_store.list_images(store):
                oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)
