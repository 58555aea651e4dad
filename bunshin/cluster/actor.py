"""The host actor: one per Ray node, owning that node's ``bunshin serve``.

A plain class: :mod:`bunshin.cluster.ray_cluster` makes it a Ray actor pinned to its
node. It reports the node's state (:class:`~bunshin.cluster.records.HostInfo`) and its
server's URL and epoch, signed (:class:`~bunshin.cluster.records.SignedEndpoint`). It
hands out no token or key: it reads the cluster secret from its own node's file
(:mod:`bunshin.cluster.secret`) and derives its server's token and the snapshot key
there; the head derives the same token from its own copy.

It keeps its home's lease (:mod:`bunshin.cluster.fence`): at start and every
``RENEW_S`` seconds it compares the home's epoch with the cluster's; a home the head
fenced (or whose lease ran out while no actor renewed it) is emptied first and served
again in the cluster's current epoch.

A host cut off from Ray's GCS cannot renew. Once its lease has run out unrenewed
(``lease_s``) it fences itself: its server is stopped and its home emptied, since the
cluster no longer vouches for what it holds (the head gives such a host up and retries
its work elsewhere; Ray counts its node dead). It serves again only if the GCS answers
again and still counts its node alive (a slow GCS, not a partition); a node Ray gave up
is ended by Ray, and the host comes back as a new node's actor (``cluster up``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from ..config import Config
from ..errors import BunshinError
from ..runtime.upkeep.gc import ClusterLease, read_lease, write_lease
from . import fence
from .records import HostInfo, HostLimits, SignedEndpoint
from .secret import ClusterSecret
from .serve_proc import ServeProcess, clear_home, resolve_bind

log = logging.getLogger(__name__)


class HostActor:
    """Starts the node's server in its constructor (the actor's main thread: the server's
    parent-death signal follows that thread, which lives as long as the actor)."""

    def __init__(self, name: str, node_id: str, home: str | None, *, bind: str, secret_file: str,
                 limits: dict[str, Any] | None = None, lease_s: float = fence.LEASE_S) -> None:
        self.name, self.node_id = name, node_id
        self.limits = HostLimits(**(limits or {}))
        self.lease_s = lease_s
        self.secret = ClusterSecret.load(Path(secret_file))  # this node's copy: nothing secret came through Ray
        self.server = ServeProcess(Path(home) if home else Config.from_env().home, bind=resolve_bind(bind),
                                   limits=self.limits, key=self.secret.snapshot_key())
        self._lock = threading.RLock()  # the server and the lease: methods vs the renewing thread
        self.cleared: list[dict[str, int]] = []  # what each fence removed (status reports the count)
        self.lapsed = False  # its lease ran out unrenewed: it fenced itself (see the module)
        self.epoch = self._join()
        self._renewed = time.monotonic()  # when the cluster last answered a renewal
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="bunshin-lease", daemon=True)
        self._renewer.start()
        self._watchdog = threading.Thread(target=self._watch_lease, name="bunshin-lease-watch", daemon=True)
        self._watchdog.start()

    # --- the lease ------------------------------------------------------------------------

    def _lease(self, *, expires: bool = True, fenced: bool = False) -> None:
        write_lease(self.server.cfg, ClusterLease(self.name, self.epoch,
                                                  time.time() + self.lease_s if expires else None, fenced))

    def _join(self) -> int:
        """Serve in the cluster's epoch for this host: what the home holds from an older
        (fenced) epoch, or from a lease that ran out, is removed first."""
        with self._lock:
            cfg, lease = self.server.cfg, read_lease(self.server.cfg)
            cfg.home.mkdir(parents=True, exist_ok=True)
            current = fence.epoch(self.secret, self.name)
            if current is not None and lease is not None and current < lease.epoch:
                fence.reject(f"epoch/{self.name}", f"epoch {current} is older than the home's {lease.epoch}")
                current = None  # a replayed record: the home's own epoch is signed again below
            stale = lease is not None and (lease.lost() or (current is not None and lease.epoch != current))
            if current is None:  # a new cluster: it takes a home whose lease holds as it is
                current = lease.epoch + int(stale) if lease is not None else 1
                fence.set_epoch(self.secret, self.name, current)
            elif (lease is not None and lease.epoch == current and lease.lost()) or (
                    self.lapsed and self.epoch == current):
                current = fence.fence(self.secret, self.name)  # its lease ran out unrenewed: that epoch is over
            if lease is not None and stale:
                self.server.stop()
                self.cleared.append(clear_home(cfg))
                log.warning("host %s: epoch %d was fenced (now %d): removed %s", self.name, lease.epoch,
                            current, self.cleared[-1])
            # the epoch's own token: a call the head still retries from before a fence is
            # refused rather than making what nobody tracks
            if self.server.set_token(self.secret.host_token(self.name, current)) and self.server.running():
                self.server.stop()  # it holds another epoch's token
            if not self.server.running():
                self.server.start()  # fails: the epoch stays the old one, the next renewal tries again
            self.epoch = current
            self._lease()
            fence.set_serving(self.secret, self.name, current)
            self.lapsed, self._renewed = False, time.monotonic()
            return current

    def _renew_loop(self) -> None:
        while not self._stop.wait(fence.RENEW_S):
            try:  # blocks while the GCS is cut off (Ray's client retries): the watchdog sees it
                current = fence.epoch(self.secret, self.name)
                node_alive = not self.lapsed or self._node_alive()
            except Exception as e:  # the GCS does not answer: no renewal, the lease runs out
                log.warning("host %s: no answer from the cluster (%s): lease not renewed", self.name, e)
                continue
            self._renewed = time.monotonic()
            with self._lock:
                if self._stop.is_set():
                    return
                try:
                    if self.lapsed:
                        if not node_alive:  # Ray gave this node up: a new node's actor takes the home
                            continue
                        log.warning("host %s: the cluster answers again and counts it alive: rejoining", self.name)
                        self._join()  # its lease ran out: that epoch is fenced, the home emptied
                    elif current is not None and current > self.epoch:
                        self._lease(fenced=True)  # a crash while clearing still leaves it to gc
                        self._join()
                    else:  # an older epoch is a replayed record, never followed
                        if current is not None and current < self.epoch:
                            fence.reject(f"epoch/{self.name}", f"epoch {current} is older than {self.epoch}")
                        self._lease()
                except Exception as e:  # tried again at the next renewal; the lease runs out meanwhile
                    log.error("host %s: renewing its lease failed: %s", self.name, e)

    def _node_alive(self) -> bool:
        """Does Ray's GCS count this actor's node alive?"""
        import ray

        return any(n["NodeID"] == self.node_id and n.get("Alive") for n in ray.nodes())

    def _watch_lease(self) -> None:
        """Fence this host itself once its lease has run out unrenewed: stop serving, and
        empty the home (nothing in it is the cluster's any more)."""
        while not self._stop.wait(fence.RENEW_S / 2):
            if self.lapsed or time.monotonic() - self._renewed < self.lease_s:
                continue
            if not self._lock.acquire(timeout=fence.RENEW_S):  # a join blocked on the GCS holds it
                continue
            try:
                if self._stop.is_set() or self.lapsed or time.monotonic() - self._renewed < self.lease_s:
                    continue
                self.lapsed = True
                log.error("host %s: no renewal for %.0f s (cut off from the cluster?): it stops serving and "
                          "empties its home", self.name, self.lease_s)
                self._lease(fenced=True)
                self.server.stop()
                self.cleared.append(clear_home(self.server.cfg))
                self.server.token_file.unlink(missing_ok=True)
            except Exception as e:  # gc on the host finishes the job (the lease says fenced)
                log.error("host %s: emptying its home failed: %s", self.name, e)
            finally:
                self._lock.release()

    def endpoint(self) -> SignedEndpoint:
        """Its server's URL and epoch, signed (no token: the head derives it)."""
        url, epoch = self.server.url, self.epoch
        return SignedEndpoint(self.name, url, epoch, self.secret.sign("endpoint", self.name, url, epoch))

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
        elif self.lapsed:
            error = "its lease ran out unrenewed (cut off from the cluster?): it stopped serving, its home emptied"
        else:
            error = "its bunshin serve is not running"
        return HostInfo(name=self.name, node_id=self.node_id, url=self.server.url, home=str(self.server.cfg.home),
                        alive=alive, pid=self.pid(), free_memory=vm.available, total_memory=vm.total,
                        load=round(load, 3), workspaces=workspaces, snapshots=snapshots, limits=self.limits,
                        error=error, epoch=self.epoch, fenced=len(self.cleared),
                        rejected=fence.rejected()).to_dict()

    def restart(self) -> SignedEndpoint:
        """Start the server again (after it died): it re-adopts what is still running,
        ``bunshin gc`` style cleanup of the rest is the server's own."""
        with self._lock:
            self.server.stop()
            self.server.start()
            return self.endpoint()

    def kill_server(self) -> None:
        """SIGKILL the server, as a crash of the host's service would (tests, fault drills)."""
        self.server.kill()

    def gc(self) -> dict[str, Any]:
        """``bunshin gc`` on this host's home (its server stopped first: gc removes what
        no live process owns)."""
        from ..runtime.state.store import Store
        from ..runtime.upkeep import gc

        with self._lock:
            self.server.stop()
            with Store.open(self.server.cfg.db_path) as store:
                report = gc.collect(self.server.cfg, store, release=True)
            return {"removed": report.total}

    def reclaim(self) -> dict[str, Any]:
        """A host the head gave up on comes back: what it ran was retried elsewhere, so
        its epoch is fenced, its server stopped, everything of its home removed
        (:func:`clear_home`), and the server started again, empty, in the new epoch;
        what was removed, by kind."""
        with self._lock:
            fence.fence(self.secret, self.name)
            before = len(self.cleared)
            self._join()
            return self.cleared[-1] if len(self.cleared) > before else {"workspaces": 0, "snapshots": 0, "gc": 0}

    def stop(self) -> None:
        """The server stopped on purpose (``cluster down``): the lease is parked, so the
        next start in this cluster takes the home back as it is."""
        self._stop.set()
        with self._lock:
            self.server.stop()
            self._lease(expires=False)
