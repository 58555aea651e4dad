"""The host actor: one per Ray node, owning that node's ``bunshin serve``.

A plain class: :mod:`bunshin.cluster.ray_cluster` makes it a Ray actor pinned to its
node. It reports the node's state (:class:`~bunshin.cluster.records.HostInfo`) and
hands the head its server's URL and token (:class:`~bunshin.cluster.records.Endpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

from ..config import Config
from ..errors import BunshinError
from .records import Endpoint, HostInfo, HostLimits
from .serve_proc import ServeProcess, clear_home


class HostActor:
    """Starts the node's server in its constructor (the actor's main thread: the server's
    parent-death signal follows that thread, which lives as long as the actor)."""

    def __init__(self, name: str, node_id: str, home: str | None, *, bind: str, key: bytes,
                 limits: dict[str, Any] | None = None) -> None:
        self.name, self.node_id = name, node_id
        self.limits = HostLimits(**(limits or {}))
        self.server = ServeProcess(Path(home) if home else Config.from_env().home, bind=bind, limits=self.limits,
                                   key=key)
        self.server.start()

    def endpoint(self) -> Endpoint:
        return Endpoint(self.name, self.server.url, self.server.token())

    def pid(self) -> int | None:
        return self.server.proc.pid if self.server.proc is not None else None

    def status(self) -> dict[str, Any]:
        """This host as :class:`HostInfo` (a dict: Ray moves plain data)."""
        from ..client import Client

        vm = psutil.virtual_memory()
        load = os.getloadavg()[0] / (psutil.cpu_count() or 1)
        workspaces, snapshots, error = 0, [], None
        alive = self.server.running()
        if alive:
            try:
                with Client(self.server.url, token=self.server.token(), timeout=10.0) as c:
                    workspaces = sum(1 for w in c.list() if w.state != "dead")
                    snapshots = [s.id for s in c.snapshots()]
            except BunshinError as e:
                alive, error = False, str(e)
        else:
            error = "its bunshin serve is not running"
        return HostInfo(name=self.name, node_id=self.node_id, url=self.server.url, home=str(self.server.cfg.home),
                        alive=alive, pid=self.pid(), free_memory=vm.available, total_memory=vm.total,
                        load=round(load, 3), workspaces=workspaces, snapshots=snapshots, limits=self.limits,
                        error=error).to_dict()

    def restart(self) -> Endpoint:
        """Start the server again (after it died): it re-adopts what is still running,
        ``bunshin gc`` style cleanup of the rest is the server's own."""
        self.server.stop()
        self.server.start()
        return self.endpoint()

    def kill_server(self) -> None:
        """SIGKILL the server, as a crash of the host's service would (tests, fault drills)."""
        self.server.kill()

    def gc(self) -> dict[str, Any]:
        """``bunshin gc`` on this host's home (its server stopped first: gc removes what
        no live process owns)."""
        from ..runtime import gc
        from ..runtime.store import Store

        self.server.stop()
        with Store.open(self.server.cfg.db_path) as store:
            report = gc.collect(self.server.cfg, store, release=True)
        return {"removed": report.total}

    def reclaim(self) -> dict[str, Any]:
        """A host the head gave up on comes back: what it ran was retried elsewhere, so
        its server is stopped, everything of its home removed (:func:`clear_home`), and
        the server started again, empty; what was removed, by kind."""
        self.server.stop()
        removed = clear_home(self.server.cfg)
        self.server.start()
        return removed

    def stop(self) -> None:
        self.server.stop()
