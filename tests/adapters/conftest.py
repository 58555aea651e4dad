"""Fixtures of the adapter tests: a private home whose task roots the adapters free after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bunshin.config import Config
from bunshin.rollout.task import parse_task
from tests.server.conftest import served  # noqa: F401  (a real `bunshin serve` on loopback)

#: A small task: setup once (a file the trajectories read), a reward from a file they write.
TASK = parse_task({
    "id": "adapt",
    "memory": "512M",
    "files": {"/work/hello.txt": "hello\n"},
    "setup": ["echo setup-ran > /work/setup.log", "cat /proc/sys/kernel/random/uuid > /work/setup.id"],
    "tools": ["bash", "read_file", "write_file"],
    "workdir": "/work",
    "prompt": "write the score",
    "max_turns": 4,
    "reward": "cat /work/score 2>/dev/null || echo 0",
    "call_timeout": 20,
    "trajectory_timeout": 120,
})


@pytest.fixture
def home(no_leaks: Config) -> Iterator[Config]:
    """The test's home; every task root the adapters made in it is freed before the leak check."""
    from bunshin.adapters.trajectories import close_all

    try:
        yield no_leaks
    finally:
        close_all()
