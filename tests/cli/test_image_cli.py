"""Integration: ``bunshin image load|pull|ls|inspect|rm``, ``create --image`` and ``gc``
across invocations (issue 11)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

from tests.cli.test_cli import bunshin
from tests.runtime import oci_images as oi

pytestmark = pytest.mark.integration


def test_image_commands_across_invocations(no_leaks, tmp_path: Path) -> None:
    cfg = no_leaks
    layout = tmp_path / "layout"
    info = oi.build_layout(layout, [oi.busybox_base(), oi.Layer().add("srv", "dir").add("srv/x", "file", "x\n")],
                           config={"WorkingDir": "/srv", "Env": ["MODE=cli"]})
    archive = oi.compress(oi.docker_archive(layout, tmp_path / "img.tar", "cli/img:1"), "zst")
    loaded = json.loads(bunshin(cfg, "image", "load", str(archive), "--tag", "cli/other:2", "--json").stdout)
    (img,) = loaded["images"]
    assert img["id"] == info["config"] and img["layers"] == 2
    assert set(img["names"]) == {"docker.io/cli/img:1", "docker.io/cli/other:2"}
    r = bunshin(cfg, "image", "load", str(layout))  # again, from the layout: nothing new
    assert r.stdout.strip() == info["config"] and "already stored" in r.stderr
    listed = json.loads(bunshin(cfg, "image", "ls", "--json").stdout)
    assert [i["id"] for i in listed if i["id"] == info["config"]] == [info["config"]]
    assert "cli/img:1" in bunshin(cfg, "image", "ls").stdout
    seen = json.loads(bunshin(cfg, "image", "inspect", "cli/img:1", "--json").stdout)
    assert seen["layers"] == info["diff_ids"] and seen["config"]["env"] == ["MODE=cli"]
    ws = json.loads(bunshin(cfg, "create", "--image", "cli/img:1", "--memory", "256M", "--json").stdout)
    try:
        assert bunshin(cfg, "exec", ws["id"], "--", "sh", "-c", "echo $MODE $(pwd) $(cat x)").stdout == "cli /srv x\n"
        assert json.loads(bunshin(cfg, "image", "rm", "cli/other:2", "--json").stdout)["freed_layers"] == []
        out = json.loads(bunshin(cfg, "image", "rm", "cli/img:1", "--json").stdout)
        assert out["removed"] == [info["config"]] and out["freed_layers"] == [], "the workspace still stacks them"
    finally:
        bunshin(cfg, "rm", ws["id"])
    report = json.loads(bunshin(cfg, "gc", "--json").stdout)
    assert sorted(Path(p).name for p in report["image_layers"]) == sorted(d[7:] for d in info["diff_ids"])


@pytest.mark.parametrize("args, message", [
    (("image", "inspect", "no/such:1"), "no stored image"),
    (("image", "rm", "no/such:1"), "no stored image"),
    (("image", "load", "/no/such.tar"), "no image file or folder"),
    (("image", "pull", "127.0.0.1:1/team/x:1"), "cannot reach the registry"),
    (("image", "pull", "Not A Ref"), "not an image reference"),
    (("create", "--image", "no/such:1"), "neither a folder nor a stored image"),
])
def test_image_errors_are_clear(cfg, args: tuple[str, ...], message: str) -> None:
    r = bunshin(cfg, *args, check=False)
    assert r.returncode == 125 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_image_pull_shows_progress_and_prints_json(no_leaks, tmp_path: Path) -> None:
    cfg = no_leaks
    info = oi.build_layout(tmp_path / "layout", [oi.busybox_base()], config={"Cmd": ["sh"]})
    (tmp_path / "reg").mkdir()
    with oi.Registry(tmp_path / "reg") as reg:
        ref = reg.push(tmp_path / "layout", "cli/pulled:3")
        r = bunshin(cfg, "image", "pull", ref)
        assert r.stdout.strip() == info["config"]
        assert "Copying blob" in r.stderr and "unpacking" in r.stderr, r.stderr
        out = json.loads(bunshin(cfg, "image", "pull", f"{ref.rsplit(':', 1)[0]}@{info['manifest']}", "--json").stdout)
        assert out["id"] == info["config"] and info["manifest"] in out["digests"]
    bunshin(cfg, "image", "rm", info["config"])
    bunshin(cfg, "gc")


@pytest.fixture
def loopback_listener():
    """A TCP server on the host's 127.0.0.1 (random port) counting the connections it accepts."""
    accepted: list[str] = []
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            accepted.append("x")
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], accepted
    finally:
        stop.set()
        t.join()
        srv.close()


def test_build_steps_get_no_network_unless_host_is_asked_with_a_warning(no_leaks, tmp_path: Path,
                                                                          loopback_listener) -> None:
    """A Dockerfile's RUN tries the host's loopback: by default it cannot reach it (its own
    network namespace); only with --network host, which warns; egress is refused by name."""
    cfg, (port, accepted) = no_leaks, loopback_listener
    oi.build_layout(tmp_path / "base", [oi.busybox_base()])
    oi.oci_archive(tmp_path / "base", tmp_path / "base.tar")
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(
        f"FROM oci-archive:{tmp_path / 'base.tar'}\n"
        f"RUN (busybox nc -w 5 127.0.0.1 {port} </dev/null && echo reached || echo unreachable) > /net\n")
    r = bunshin(cfg, "image", "build", str(ctx), "--network", "egress", check=False)
    assert r.returncode == 125 and "network 'egress'" in r.stderr and "not supported" in r.stderr, r.stderr
    ids = []
    try:
        for args, want in ((), "unreachable\n"), (("--network", "host"), "reached\n"):
            r = bunshin(cfg, "image", "build", str(ctx), *args, "--json", timeout=600)
            rec = json.loads(r.stdout)
            ids.append(rec["id"])
            layers = json.loads(bunshin(cfg, "image", "inspect", rec["id"], "--json").stdout)["layers"]
            assert (cfg.paths.image_layer(layers[-1]) / "net").read_text() == want
            assert ("warning: RUN steps share the host's network namespace" in r.stderr) == bool(args), r.stderr
            assert len(accepted) == (1 if args else 0)
    finally:
        if ids:
            bunshin(cfg, "image", "rm", *ids)


def test_caps_are_set_by_flag_or_environment_and_a_pull_is_refused_before_download(
        no_leaks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = no_leaks
    before = bunshin(cfg, "image", "ls", "--json").stdout
    layout = tmp_path / "layout"
    oi.build_layout(layout, [oi.busybox_base(), oi.Layer().add("f", "file", "f\n")])
    (tmp_path / "reg").mkdir()
    with oi.Registry(tmp_path / "reg") as reg:
        ref = reg.push(layout, "cli/capped:1")
        for args, why in ((("--max-layers", "1"), "2 layers, more than the layer cap image_max_layers=1"),
                          (("--max-size", "1K"), "layer blobs goes past the image size cap image_max_bytes=1024")):
            r = bunshin(cfg, "image", "pull", ref, *args, check=False)
            assert r.returncode == 125 and why in r.stderr, r.stderr
            assert "Copying blob" not in r.stderr, "refused from the manifest, before a blob is fetched"
    monkeypatch.setenv("BUNSHIN_IMAGE_MAX_BYTES", "1M")  # busybox alone unpacks to ~2 MiB
    r = bunshin(cfg, "image", "load", str(layout), check=False)
    assert r.returncode == 125 and "image_max_bytes=1048576" in r.stderr and "--max-size" in r.stderr, r.stderr
    r = bunshin(cfg, "image", "load", str(layout), "--max-size", "abc", check=False)
    assert r.returncode == 125 and "'abc' is not a size" in r.stderr, r.stderr
    assert bunshin(cfg, "image", "ls", "--json").stdout == before, "nothing stored"
    assert not list(cfg.paths.image_staging.iterdir())
