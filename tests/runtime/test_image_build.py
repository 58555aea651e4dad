"""``bunshin image build`` (issue 11): a Dockerfile built by Debian's buildah, its RUN
steps root only inside a user namespace mapped onto the workspaces' range; the
result loads into the store and runs as ``docker run`` would; a failing step stores
nothing and leaves no mount."""

from __future__ import annotations

import dataclasses
import secrets
import shutil
from pathlib import Path

import psutil
import pytest

from bunshin.config import Config
from bunshin.errors import InvalidArgument, PayloadTooLarge
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.oci import build as oci_build
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace
from tests.runtime import oci_images as oi

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah: run `make install`")]

DOCKERFILE = """FROM oci-archive:{base}
RUN cat /proc/self/uid_map > /uid_map && id -u > /built_by && mkdir /srv && echo hi > /srv/hello
ENV BUILT=yes
WORKDIR /srv
USER app
CMD ["sleep", "1005"]
"""


@pytest.fixture
def context(tmp_path: Path) -> Path:
    oi.build_layout(tmp_path / "base", [oi.busybox_base()])
    oi.oci_archive(tmp_path / "base", tmp_path / "base.tar")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=tmp_path / "base.tar"))
    return ctx


def test_build_runs_in_a_user_namespace_and_the_image_runs(context: Path, cfg: Config, no_leaks) -> None:
    with Store.open(cfg.db_path) as store:
        rec = oci_build.build(cfg, store, context, tags=("built/one:1",))
    try:
        assert rec.config.user == "app" and rec.config.working_dir == "/srv" and rec.config.cmd == ("sleep", "1005")
        with Workspace.create("built/one:1", memory="256M", config=cfg) as ws:
            out = ws.exec("cat /uid_map /built_by /srv/hello; echo $BUILT; pwd; id -un").stdout.split()
            assert out == ["0", str(cfg.id_base), str(cfg.id_count), "0", "hi", "yes", "/srv", "app"], out
            assert "sleep 1005" in ws.exec("ps -o args").stdout
        top = cfg.paths.image_layer(rec.layers[-1])
        assert (top / "srv" / "hello").stat().st_uid == cfg.id_base, "root of the build is the workspaces' root"
        assert not list(cfg.paths.image_staging.iterdir()), "buildah's storage is gone"
    finally:
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)


def test_a_failing_step_stores_nothing(context: Path, cfg: Config, tmp_path: Path) -> None:
    (context / "Dockerfile").write_text((context / "Dockerfile").read_text().replace("echo hi", "exit 3; echo hi"))
    with Store.open(cfg.db_path) as store:
        before = oci_store.list_images(store)
        with pytest.raises(InvalidArgument, match="image build failed") as exc:
            oci_build.build(cfg, store, context)
        assert "nothing was stored" in (exc.value.hint or "")
        assert oci_store.list_images(store) == before
    assert not list(cfg.paths.image_staging.iterdir())
    assert not [m for m in mountinfo.mount_points() if str(cfg.paths.images) in m]
    with pytest.raises(InvalidArgument, match="no Dockerfile"):
        oci_build.build(cfg, Store.open(cfg.db_path), tmp_path)


def test_a_step_that_writes_past_the_cap_is_killed_and_stores_nothing(context: Path, cfg: Config) -> None:
    """RUN writes 512 MiB (a Dockerfile could write until the disk is full): with a 64 MiB image
    cap the build's storage may hold 128 MiB; buildah, runc and the step are killed together."""
    mark = f"30.{secrets.randbelow(10**6):06d}"  # a sleep of its own, found by its command line
    (context / "Dockerfile").write_text(
        (context / "Dockerfile").read_text().split("\n")[0]
        + f"\nRUN busybox dd if=/dev/zero of=/fill bs=1M count=512 && busybox sleep {mark}\n")
    with Store.open(cfg.db_path) as store:
        before = oci_store.list_images(store)
        with pytest.raises(PayloadTooLarge, match=r"build's storage .* image_max_bytes=67108864") as exc:
            oci_build.build(dataclasses.replace(cfg, image_max_bytes="64M"), store, context)
        assert "--max-size" in (exc.value.hint or "")
        assert oci_store.list_images(store) == before
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if mark in " ".join(p.info["cmdline"] or ())]
    assert not list(cfg.paths.image_staging.iterdir())
    assert not [m for m in mountinfo.mount_points() if str(cfg.paths.images) in m]
