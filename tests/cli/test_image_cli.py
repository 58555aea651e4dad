"""Integration: ``bunshin image load|pull|ls|inspect|rm``, ``create --image`` and ``gc``
across invocations (issue 11)."""

from __future__ import annotations

import json
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
    assert r.returncode == 1 and message in r.stderr, r.stderr
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
