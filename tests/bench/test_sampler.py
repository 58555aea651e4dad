"""``bench.sampler.HomeMemory``: a home's files counted as the memory they hold (real files, real links)."""

from __future__ import annotations

import os
from pathlib import Path

from bunshin.bench.sampler import HomeMemory
from bunshin.config import Config

MIB = 1 << 20


def test_a_memory_file_linked_from_many_layers_counts_once(tmp_path: Path) -> None:
    """A live pre-copy file sits in paths.mem and is linked from every snapshot's layer: one copy of memory."""
    cfg = Config(home=tmp_path / "home", tmpfs=tmp_path / "tmpfs")
    mem = cfg.paths.mem
    mem.mkdir(parents=True)
    live = mem / "live-ws-000000000000-00000000.bunshin-mem"
    live.write_bytes(b"\x01" * (4 * MIB))
    one = live.stat().st_blocks * 512
    for snap in ("snap-a", "snap-b", "snap-c"):
        folder = cfg.paths.layers / snap / ".bunshin" / "mem"
        folder.mkdir(parents=True)
        os.link(live, folder / live.name)
    own = cfg.paths.layers / "snap-a" / "upper-file"
    own.write_bytes(b"\x02" * MIB)  # a file of the layer's own counts too
    agent = cfg.paths.layers / "agent-1"
    agent.mkdir()
    (agent / "lib").write_bytes(b"\x03" * MIB)  # the agent's cache layer does not
    assert HomeMemory(cfg).files() == one + own.stat().st_blocks * 512
