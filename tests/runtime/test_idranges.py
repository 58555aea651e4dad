"""Host id ranges of workspaces (``idranges``) and their views (``range_views``): each
workspace and clone a range of its own, freed with it; what a crash leaves, gc takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bunshin.runtime.container import idmap, range_views, statefs
from bunshin.runtime.state import idranges
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc

pytestmark = [pytest.mark.integration]


def test_ranges_are_distinct_above_the_layers_range_and_freed(cfg):
    with Store.open(cfg.db_path) as store:
        bases = [idranges.reserve(cfg, store, f"ws-{i}") for i in range(64)]
        assert len(set(bases)) == 64
        for b in bases:  # whole ranges above range 0 (the layers' own), inside the id space
            assert b >= cfg.id_base + cfg.id_count and (b - cfg.id_base) % cfg.id_count == 0
            assert b + cfg.id_count - 1 <= 0xFFFFFFFE
        assert idranges.held(cfg, store) == {b: f"ws-{i}" for i, b in enumerate(bases)}
        for b in bases:
            idranges.free(cfg, store, b)
        assert idranges.held(cfg, store) == {}


def test_a_workspace_holds_its_range_until_removed(no_leaks):
    from bunshin.workspace import Workspace

    ws = Workspace.create("host", memory="256M", pids=64, config=no_leaks)
    try:
        with Store.open(no_leaks.db_path) as store:
            assert idranges.held(no_leaks, store) == {ws.record.ids: ws.id}
        views = idmap.range_dir(no_leaks, ws.record.ids)
        assert sorted(os.listdir(views))  # its views of the host's / and the mask layer
    finally:
        ws.remove()
    with Store.open(no_leaks.db_path) as store:
        assert idranges.held(no_leaks, store) == {}
    assert not views.exists()


def test_gc_frees_what_a_dead_maker_left(no_leaks):
    cfg = no_leaks
    statefs.ensure(cfg)
    # a maker killed between reserving a range (and mounting its views) and recording its workspace
    code = ("import sys; from bunshin.runtime.state import idranges; from bunshin.runtime.state.store import Store; "
            "from bunshin.config import Config; cfg = Config.for_home(sys.argv[1]); "
            "print(idranges.reserve(cfg, Store.open(cfg.db_path), 'ws-gone'))")
    out = subprocess.run([sys.executable, "-c", code, str(cfg.home)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    base = int(out.stdout)
    wdir = cfg.paths.workspaces / "ws-gone"
    wdir.mkdir(parents=True)
    lowers, upper = range_views.overlay(cfg, base, ["/"], wdir)  # a view of the host's /, and of its folder
    assert idmap.is_mounted(upper) and idmap.is_mounted(Path(lowers[0]))
    with Store.open(cfg.db_path) as store:
        assert idranges.held(cfg, store) == {base: "ws-gone"}
        report = gc.collect(cfg, store)
        assert idranges.held(cfg, store) == {}
    assert str(idmap.range_dir(cfg, base)) in report.mounts and not idmap.range_dir(cfg, base).exists()
    assert not wdir.exists() and str(upper) in report.mounts  # its folder and the view in it went too
