"""Many workspaces removed in one call (``remove_all``): the batch form of ``Workspace.remove``."""

from __future__ import annotations

from collections.abc import Iterable

from ..runtime import snapshot as rsnap
from ..runtime.container import teardown
from ..runtime.state.store import Store
from .workspace import Workspace


def remove_all(workspaces: Iterable[Workspace]) -> None:
    """Remove every workspace given, each step for all of them at once (kill all, wait
    once, unmount lazily, one store transaction; ``teardown.destroy_many``), then free
    the snapshots nothing holds any more. Workspaces of several homes are removed home
    by home."""
    by_home: dict[str, list[Workspace]] = {}
    for ws in workspaces:
        by_home.setdefault(str(ws.config.db_path), []).append(ws)
    for group in by_home.values():
        cfg = group[0].config
        with Store.open(cfg.db_path) as store:
            teardown.destroy_many(cfg, store, [ws.record for ws in group])
            rsnap.sweep(cfg, store)
