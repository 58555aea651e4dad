"""Harbor's own Trial (oracle agent) on BunshinEnvironment, -k trials of one task.

Needs Harbor (`pip install harbor`, Python >= 3.12) next to bunshin, e.g. a 3.12 venv with
harbor and bunshin's dependencies and PYTHONPATH=<this checkout>; as root:
`python examples/harbor/trial.py [-k 8] [--no-fork]`. The task is the one of run.py
(a Dockerfile FROM a busybox base made here, solution/solve.sh, tests/test.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig
from harbor.trial.trial import Trial

from bunshin.adapters.harbor import BunshinEnvironment

sys.path.insert(0, str(Path(__file__).parent))
from run import make_task  # type: ignore[import-not-found]  # noqa: E402

TOML = ('schema_version = "1.4"\n[metadata]\n[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n'
        '[environment]\nbuild_timeout_sec = 600.0\nmemory_mb = 256\n')


async def trials(task: Path, out: Path, k: int, fork: bool) -> list[object]:
    env = EnvironmentConfig(import_path="bunshin.adapters.harbor:BunshinEnvironment", kwargs={"fork": fork})
    made = [await Trial.create(TrialConfig(task=TaskConfig(path=task), trial_name=f"{task.name}__{i}",
                                           trials_dir=out, agent=AgentConfig(name="oracle"), environment=env))
            for i in range(k)]
    return list(await asyncio.gather(*(t.run() for t in made)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--no-fork", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        task = make_task(Path(tmp))
        (task / "task.toml").write_text(TOML)
        t0 = time.perf_counter()
        try:
            results = asyncio.run(trials(task, Path(tmp) / "trials", args.k, not args.no_fork))
        finally:
            BunshinEnvironment.release_roots()
        for r in results:
            vr, exc = getattr(r, "verifier_result", None), getattr(r, "exception_info", None)
            print(getattr(r, "trial_name", "?"), "rewards", vr.rewards if vr else None,
                  "error", exc.exception_message[:300] if exc else None)
        print(f"{args.k} trials ({'no fork' if args.no_fork else 'fork'}) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
