"""A Harbor task's trials on bunshin (as root: `python examples/harbor/run.py [--no-fork]`).

Harbor's oracle trial, four times (``harbor run -k 4``), each on its own BunshinEnvironment:
start (the task's Dockerfile built once by ``bunshin image build``; the first trial boots it
and snapshots the root, the others restore from it), upload and run the solution, upload and
run the tests, download /logs/verifier, read the reward, stop. The Dockerfile's base is a
busybox image made here (no Docker Hub). Harbor needs Python >= 3.12: in a 3.11 venv the
example uses the stand-in of its interface in tests/adapters/harbor_interface.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("harbor") is None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "adapters" / "harbor_interface"))

from harbor.models.task.config import EnvironmentConfig  # noqa: E402

from bunshin.adapters.harbor import BunshinEnvironment  # noqa: E402
from bunshin.bench.oci_build import build_layout, busybox_base, oci_archive  # noqa: E402

DOCKERFILE = """FROM oci-archive:{base}
RUN mkdir -p /app && echo 'add() { echo $(( $1 - $2 )); }' > /app/calc.sh
WORKDIR /app
CMD ["sleep", "100000"]
"""
FILES = {
    "solution/solve.sh": "#!/bin/sh\necho 'add() { echo $(( $1 + $2 )); }' > /app/calc.sh\n",
    "tests/test.sh": "#!/bin/sh\n. /app/calc.sh\n[ \"$(add 2 3)\" = 5 ] && echo 1 > /logs/verifier/reward.txt "
                     "|| echo 0 > /logs/verifier/reward.txt\n",
    "instruction.md": "Fix add() in /app/calc.sh\n",
}


def make_task(root: Path) -> Path:
    build_layout(root / "base", [busybox_base()])
    oci_archive(root / "base", root / "base.tar")
    task = root / "fix-add"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE.replace("{base}", str(root / "base.tar")))
    for rel, text in FILES.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    return task


async def trial(task: Path, i: int, out: Path, fork: bool) -> float:
    env = BunshinEnvironment(environment_dir=task / "environment", environment_name=task.name,
                             session_id=f"{task.name}__{i}__env", trial_paths=None,
                             task_env_config=EnvironmentConfig(memory_mb=256), fork=fork)
    await env.start(force_build=False)
    try:
        await env.upload_dir(task / "solution", "/solution")
        await env.exec("sh /solution/solve.sh")
        await env.upload_dir(task / "tests", "/tests")
        await env.exec("sh /tests/test.sh", timeout_sec=30)
        await env.download_dir("/logs/verifier", out / f"trial-{i}")
        return float((out / f"trial-{i}" / "reward.txt").read_text())
    finally:
        await env.stop(delete=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fork", action="store_true", help="a fresh workspace from the image per trial")
    ap.add_argument("-k", type=int, default=4, help="trials of the task")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        task = make_task(Path(tmp))
        t0 = time.perf_counter()
        try:
            rewards = asyncio.run(_all(task, Path(tmp) / "out", args.k, not args.no_fork))
        finally:
            BunshinEnvironment.release_roots()
        print(f"{args.k} trials, rewards {rewards}, {time.perf_counter() - t0:.1f} s "
              f"({'forked from one root' if not args.no_fork else 'one workspace each'}, image built once)")
        assert rewards == [1.0] * args.k


async def _all(task: Path, out: Path, k: int, fork: bool) -> list[float]:
    return list(await asyncio.gather(*(trial(task, i, out, fork) for i in range(k))))


if __name__ == "__main__":
    main()
