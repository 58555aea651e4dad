"""Harbor: BunshinEnvironment runs a small real Harbor task (Dockerfile, solution, tests) as
Harbor's trial does: start, upload the solution and run it, upload the tests and run them,
download the verifier's folder, read the reward, stop. Harbor needs Python >= 3.12 and this
venv runs 3.11, so without it installed the test imports the stand-in of harbor 0.25.0's
interface in harbor_interface/ (same module paths, classes and signatures; see its README).
The Dockerfile is built for real by ``bunshin image build`` (buildah) FROM a busybox base made
in the test; the task's three trials fork from one started environment."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("harbor") is None:
    sys.path.insert(0, str(Path(__file__).with_name("harbor_interface")))

from harbor.models.task.config import EnvironmentConfig  # noqa: E402

from bunshin.adapters import harbor as adapter  # noqa: E402
from bunshin.adapters._group import GROUPS  # noqa: E402
from bunshin.errors import InvalidArgument, ResourceExhausted, StateConflict  # noqa: E402
from bunshin.runtime.oci import store as oci_store  # noqa: E402
from bunshin.runtime.state.store import Store  # noqa: E402
from bunshin.runtime.upkeep import gc  # noqa: E402
from tests.runtime import oci_images as oi  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.criu,
              pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah: run `make install`")]

DOCKERFILE = """FROM oci-archive:{base}
RUN mkdir -p /app && chmod 777 /app && cat /proc/sys/kernel/random/uuid > /build.id && echo 'def add(a, b): return a - b' > /app/calc.txt
WORKDIR /app
CMD ["sleep", "100000"]
"""
SOLVE = "#!/bin/sh\necho 'def add(a, b): return a + b' > /app/calc.txt\n"
TEST = ("#!/bin/sh\nif grep -q 'a + b' /app/calc.txt; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\necho checked > /logs/verifier/test-stdout.txt\n")


@pytest.fixture
def task(tmp_path: Path) -> Path:
    """A Harbor task folder: environment/Dockerfile, solution/solve.sh, tests/test.sh."""
    oi.build_layout(tmp_path / "base", [oi.busybox_base()])
    oi.oci_archive(tmp_path / "base", tmp_path / "base.tar")
    root = tmp_path / "hello-calc"
    for sub, name, text in (("environment", "Dockerfile", DOCKERFILE.format(base=tmp_path / "base.tar")),
                            ("solution", "solve.sh", SOLVE), ("tests", "test.sh", TEST)):
        (root / sub).mkdir(parents=True)
        (root / sub / name).write_text(text)
        os.chmod(root / sub / name, 0o755)
    (root / "instruction.md").write_text("Fix add() in /app/calc.txt\n")
    return root


@pytest.fixture
def env_home(home):
    """The test's home; Harbor roots and images built in it are freed after the test."""
    try:
        yield home
    finally:
        adapter.BunshinEnvironment.release_roots()
        with Store.open(home.db_path) as store:
            for rec in oci_store.list_images(store):
                oci_store.remove(store, rec.id)
            gc.free_image_layers(home, store)


def environment(task: Path, home, i: int, **kw) -> adapter.BunshinEnvironment:
    """As Harbor's EnvironmentFactory builds one per trial (its constructor's arguments)."""
    return adapter.BunshinEnvironment(environment_dir=task / "environment", environment_name=task.name,
                                      session_id=f"{task.name}__t{i}__env", trial_paths=None,
                                      task_env_config=EnvironmentConfig(memory_mb=256), bunshin_config=home, **kw)


async def trial(env: adapter.BunshinEnvironment, task: Path, out: Path) -> float:
    """Harbor's oracle trial against an already started environment: solve, verify, download."""
    await env.upload_dir(task / "solution", "/solution")
    r = await env.exec("sh /solution/solve.sh")
    assert r.return_code == 0, r.stderr
    await env.upload_dir(task / "tests", "/tests")
    r = await env.exec("sh /tests/test.sh", timeout_sec=30)
    assert r.return_code == 0, r.stderr
    await env.download_dir("/logs/verifier", out)
    return float((out / "reward.txt").read_text())


def test_trials_of_a_task_fork_one_started_environment(task: Path, env_home, tmp_path: Path):
    envs = [environment(task, env_home, i) for i in range(3)]

    async def main() -> list[float]:
        await asyncio.gather(*(e.start(force_build=False) for e in envs))
        try:
            before = [(await e.exec("cat /build.id; cat calc.txt")).stdout for e in envs]
            assert len(set(before)) == 1 and "a - b" in before[0]  # one build, every trial from the same state
            rewards = [await trial(envs[0], task, tmp_path / "t0")]
            assert "a - b" in (await envs[1].exec("cat /app/calc.txt")).stdout  # trial 0's fix stays in trial 0
            rewards += await asyncio.gather(*(trial(e, task, tmp_path / f"t{i}") for i, e in enumerate(envs[1:], 1)))
            r = await envs[2].exec("sleep 5", timeout_sec=1)
            assert r.return_code != 0
            r = await envs[2].exec('echo "$X:$(pwd)"', cwd="/logs", env={"X": "y"})
            assert r.stdout.strip() == "y:/logs" and r.return_code == 0
            r = await envs[2].exec("id -un; touch /app/by-app", user="app")
            assert r.stdout.split() == ["app"] and r.return_code == 0, r.stderr
            assert (await envs[2].exec("stat -c %U /app/by-app")).stdout.strip() == "app"
            return rewards
        finally:
            await asyncio.gather(*(e.stop(delete=True) for e in envs))

    assert asyncio.run(main()) == [1.0, 1.0, 1.0]
    assert (tmp_path / "t2" / "test-stdout.txt").read_text() == "checked\n"
    assert len({e.group_key for e in envs}) == 1 and GROUPS.keys() == [envs[0].group_key]
    with Store.open(env_home.db_path) as store:
        (rec,) = oci_store.list_images(store)  # built once for the three trials
    assert any(n.startswith("localhost/harbor/hello-calc:") or "harbor/hello-calc:" in n for n in rec.names)
    again = environment(task, env_home, 9)
    asyncio.run(again.start(force_build=False))  # a later trial: the stored image and the root, no rebuild
    try:
        assert again.image_id == rec.id
    finally:
        asyncio.run(again.stop(delete=True))


def test_a_download_never_follows_what_the_workspace_planted(task: Path, env_home, tmp_path: Path):
    canary = tmp_path / "canary"
    canary.write_text("host secret\n")
    env = environment(task, env_home, 0, fork=False)
    out = tmp_path / "out"

    async def main() -> None:
        await env.start(force_build=False)
        try:
            r = await env.exec(f"ln -s {canary} /logs/verifier/link; ln -s / /logs/verifier/rootlink; "
                               f"mkfifo /logs/verifier/fifo; echo ok > /logs/verifier/reward.txt; "
                               f"ln -s {canary} /logs/agent/file")
            assert r.return_code == 0, r.stderr
            await env.download_dir("/logs/verifier", out)
            with pytest.raises(Exception):  # noqa: B017 - the workspace's own lookup: no host file behind it
                await env.download_file("/logs/agent/file", tmp_path / "got")
        finally:
            await env.stop(delete=True)

    asyncio.run(main())
    assert sorted(p.name for p in out.iterdir()) == ["reward.txt"]
    assert not (tmp_path / "got").exists() or "host secret" not in (tmp_path / "got").read_text()
    assert canary.read_text() == "host secret\n"
    assert GROUPS.keys() == []  # fork=False: no root


def test_bad_environments_get_clear_errors_and_leave_nothing(task: Path, env_home, tmp_path: Path):
    empty = tmp_path / "empty"
    (empty / "environment").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="Dockerfile"):
        environment(empty, env_home, 0)
    env = environment(task, env_home, 0)
    with pytest.raises(StateConflict, match="not started"):
        asyncio.run(env.exec("true"))
    dockerfile = task / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("RUN mkdir", "RUN exit 3; mkdir"))
    with pytest.raises(InvalidArgument, match="image build failed"):
        asyncio.run(env.start(force_build=False))
    assert GROUPS.keys() == []
    others = [environment(task, env_home, i) for i in range(1, 4)]  # trials waiting on that build fail with it

    async def start_all() -> list[BaseException | None]:
        return await asyncio.gather(*(e.start(force_build=False) for e in others), return_exceptions=True)

    errors = asyncio.run(start_all())
    assert all(isinstance(e, InvalidArgument) for e in errors) and len({id(e) for e in errors}) == 1
    assert GROUPS.keys() == []
    with Store.open(env_home.db_path) as store:
        assert oci_store.list_images(store) == []
    with pytest.raises(StateConflict, match="not started"):
        asyncio.run(env.upload_dir(tmp_path, "/x"))


def test_download_dir_bounds_a_hostile_tree(task: Path, env_home, tmp_path: Path, monkeypatch):
    """Folders nested past the depth limit, or more bytes than the limit: a clear error, no crash."""
    env = environment(task, env_home, 0, fork=False)
    monkeypatch.setattr(adapter, "DOWNLOAD_MAX_BYTES", 1 << 20)

    async def main() -> None:
        await env.start(force_build=False)
        try:
            deep = "/".join(["d"] * (adapter.DOWNLOAD_MAX_DEPTH + 2))
            r = await env.exec(f"mkdir -p /logs/verifier/{deep} && echo x > /logs/verifier/{deep}/f; "
                               "head -c 2000000 /dev/zero > /logs/agent/big; echo ok > /logs/agent/small")
            assert r.return_code == 0, r.stderr
            with pytest.raises(ResourceExhausted, match="deeper than"):
                await env.download_dir("/logs/verifier", tmp_path / "deep")
            with pytest.raises(ResourceExhausted, match="bytes"):
                await env.download_dir("/logs/agent", tmp_path / "big")
        finally:
            await env.stop(delete=True)

    asyncio.run(main())
    assert not (tmp_path / "big" / "big").exists()
