"""Helpers for tests that run the cache over the in-memory fake workspace."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from bunshin.testing import FakeSnapshot, FakeWorkspace, FakeWorld

T = TypeVar("T")
WORKDIR = "/w"


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def fake_root(world: FakeWorld, *, files: dict[str, str] | None = None, session: bool = True) -> FakeSnapshot:
    """A root snapshot: a workspace with ``files`` and (optionally) an open bash session in WORKDIR."""
    ws: FakeWorkspace = world.create(workdir=WORKDIR)
    for path, text in (files or {}).items():
        ws.files.write(path, text)
    if session:
        ws.sessions.open("bash", cwd=WORKDIR)
    snap = ws.snapshot()
    ws.remove()
    return snap


def state_of(ws: FakeWorkspace) -> tuple:
    """Everything observable of a fake workspace's state."""
    st = ws.state
    return (
        sorted(st.files.items()),
        sorted((sid, sorted(s.env.items()), s.cwd, s.alive) for sid, s in st.sessions.items()),
        sorted(st.procs),
    )
