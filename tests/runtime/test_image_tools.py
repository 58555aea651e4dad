"""The tools and the prefix cache on an image workspace (issue 11): a SWE-style image
(busybox, the host's bash, Debian's python3) as the task root; cached groups of calls give what
re-execution in a fresh fork gives, and hits restore forks of forks of the image."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.config import Config
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.tools import ToolSet
from bunshin.workspace import Workspace
from tests.runtime import oci_images as oi

pytestmark = [pytest.mark.integration, pytest.mark.criu]

TASK = "/task"


def bash(cmd: str) -> tuple[str, dict]:
    return "bash", {"command": cmd}


CALLS = [bash("echo one > a.txt; export V=v1; pwd"), ("python", {"code": "n = 41 + 1\nn"}),
         bash("echo $V $(cat a.txt) $(id -un)"), ("write_file", {"path": "b.txt", "content": "bee\n"}),
         bash("ls; sleep 0.6; echo slow")]


@pytest.fixture
def image_root(tmp_path: Path, cfg: Config, no_leaks):
    layout = tmp_path / "img"
    oi.build_layout(layout, [oi.busybox_base(), oi.binaries_layer("/bin/bash"), oi.python_layer(),
                             oi.Layer().add("task", "dir", None, 0o755, 1000).add("task/README", "file", "hi\n")],
                    config={"User": "app", "WorkingDir": TASK})
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, layout, tags=["tools/swe:1"])
    ws = Workspace.create("tools/swe:1", memory="512M", config=cfg)
    try:
        ws.shell(cwd=TASK)
        root = ws.snapshot()
    finally:
        ws.remove()
    yield root
    root.remove()
    with Store.open(cfg.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(cfg, store)


def outputs(obs) -> list:
    return [(o.output, o.exit_code, o.error) for o in obs]


def test_cached_calls_on_an_image_root_match_reexecution(image_root) -> None:
    ts = ToolSet.default(workdir=TASK)
    (ws,) = image_root.restore(1)
    try:
        want = [ts.run_sync(ws, n, a) for n, a in CALLS]
    finally:
        ws.remove()
    assert "v1 one app" in want[2].output and want[1].output.strip().endswith("42")

    async def go():
        cache = PrefixCache(ts, policy=CachePolicy(snapshot_min_s=0.5, shared_min_replay_s=0.0))
        try:
            runs = []
            for _ in range(2):  # the second time every call is a hit
                traj = cache.start(image_root)
                try:
                    runs.append([await traj.call(n, a) for n, a in CALLS])
                    ws = (await traj.workspace()).sync
                    runs[-1].append(await asyncio.to_thread(ws.exec, f"cat {TASK}/a.txt {TASK}/b.txt; id -un"))
                finally:
                    await traj.close()
            return runs, cache.stats()
        finally:
            await cache.aclose()

    (first, second), stats = asyncio.run(go())
    assert outputs(first[:-1]) == outputs(want) == outputs(second[:-1])
    assert all(o.cached for o in second[:-1]) and stats.divergences == 0
    assert first[-1].stdout == second[-1].stdout == "one\nbee\napp\n"
