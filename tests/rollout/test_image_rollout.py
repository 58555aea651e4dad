"""Rollouts on an image (issue 11): the rollout test's tiny task, its workspace an OCI
image (busybox, bash, Debian's python3; User app) instead of the host image, run in
every mode with the same rewards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.rollout import ModeOptions, Status, TraceReplayPolicy, parse_traces, rollout
from bunshin.rollout.task import parse_task
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from tests.runtime import oci_images as oi

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def task(image: str):
    return parse_task({
        "id": "tiny-image", "image": image, "memory": "512M",
        "files": {"/work/hello.txt": "hello\n"},
        "setup": ["echo setup-ran by $(id -un) > /work/setup.log", {"tool": "python", "arguments": {"code": "base = 40"}}],
        "workdir": "/work", "prompt": "compute", "max_turns": 6, "reward": "cat /work/score",
        "call_timeout": 20, "trajectory_timeout": 60,
    })


def traces(n: int) -> TraceReplayPolicy:
    return TraceReplayPolicy(parse_traces([json.dumps({"id": f"t{i}", "task": "tiny-image", "steps": [
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "cat hello.txt setup.log; export K=7"}},
        {"think_s": 0.05, "name": "python", "arguments": {"code": f"base += {i}\nbase"}},
        {"think_s": 0.05, "name": "bash", "arguments": {"command": "echo $K $(id -un)"}},
        {"think_s": 0.0, "name": "python", "arguments": {"code": "open('/work/score', 'w').write(str(base))"}},
    ]}) for i in range(n)]))


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rollout-image") / "layout"
    oi.build_layout(path, [oi.busybox_base(), oi.binaries_layer("/bin/bash"), oi.python_layer(),
                           oi.Layer().add("work", "dir", None, 0o755, 1000)], config={"User": "app"})
    return path


@pytest.fixture
def image(layout: Path, no_leaks: Config):
    with Store.open(no_leaks.db_path) as store:
        (rec,) = oci_store.load(no_leaks, store, layout, tags=["rollout/tiny:1"])
    yield "rollout/tiny:1"
    with Store.open(no_leaks.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(no_leaks, store)


@pytest.mark.parametrize("mode, options", [("baseline", None), ("copy", None), ("bunshin", None),
                                           ("bunshin", ModeOptions(cache=False))])
def test_every_mode_on_an_image(no_leaks: Config, image: str, mode: str, options) -> None:
    g = asyncio.run(rollout(task(image), traces(3), 3, mode=mode, options=options, config=no_leaks))
    assert [t.status for t in g.trajectories] == [Status.COMPLETED] * 3, [t.error for t in g.trajectories]
    assert g.rewards == [40.0, 41.0, 42.0]
    for t in g.trajectories:
        outs = [s.observation.output for s in t.steps]
        assert outs[0] == "hello\nsetup-ran by app\n" and outs[2] == "7 app\n", outs


def test_a_task_root_follows_its_tag_to_a_new_digest(no_leaks: Config, tmp_path: Path) -> None:
    """The engine keys a task's root by the image digest its tag names: the next group reuses
    the root while the tag holds; once the tag names another image, a new root is built from it."""
    from bunshin.rollout import RolloutEngine

    def version(v: str) -> Path:
        path = tmp_path / f"v{v}"
        oi.build_layout(path, [oi.busybox_base(), oi.Layer().add("work", "dir").add("work/version", "file", f"{v}\n")])
        return path

    spec = parse_task({"id": "moving", "image": "rollout/moving:1", "memory": "256M", "reward": "cat /work/version"})
    none = TraceReplayPolicy(parse_traces([json.dumps({"id": "t0", "steps": []})]))
    ids = []
    try:
        with Store.open(no_leaks.db_path) as store:
            ids.append(oci_store.load(no_leaks, store, version("1"), tags=["rollout/moving:1"])[0].id)

        async def go():
            async with RolloutEngine("copy", config=no_leaks) as engine:
                a = await engine.run_group(spec, none, 1)
                b = await engine.run_group(spec, none, 1)
                with Store.open(no_leaks.db_path) as store:  # the tag moves to a new image
                    ids.append(oci_store.load(no_leaks, store, version("2"), tags=["rollout/moving:1"])[0].id)
                c = await engine.run_group(spec, none, 1)
                env = await engine.env(spec)
                return a, b, c, env.task.image

        a, b, c, pinned = asyncio.run(go())
        assert (a.rewards, b.rewards, c.rewards) == ([1.0], [1.0], [2.0])
        assert b.prepare_s == a.prepare_s and c.prepare_s != a.prepare_s  # reused, then built anew
        assert pinned == ids[1] and ids[0] != ids[1]
    finally:
        with Store.open(no_leaks.db_path) as store:
            for i in ids:
                oci_store.remove(store, i)
            gc.free_image_layers(no_leaks, store)
