"""Clones made ahead: the next clone of a snapshot restored one at a time, again and again
(an E2B template's), made up to its criu run while nobody waits for it.

A restore of one spends ~4-5 ms before criu runs: the clone's record and id range, its
folder, overlay and idmapped views, identity, cgroups and images folder
(``restoring.prepare_one``). For a snapshot a caller ``want``s, one such clone is kept
ready, made in a background thread; ``take`` hands it to ``restoring.restore`` (``ready``),
which runs only criu and what follows; the next is made once that restore is done. Nothing is restored ahead:
no process of the clone exists until its restore.

A ready clone is a workspace record in state ``creating``, marked ``MADE_AHEAD`` (lists of
workspaces leave it out) and owned by this process (``gc`` removes it once the process is
gone), with its own id range, folder, overlay and cgroups; it counts in the host's pids
budget like any workspace (a server's caps leave it out). One per snapshot, for at most
:data:`MAX_SNAPSHOTS` snapshots a process (the one wanted longest ago is dropped).
``release`` destroys them (a snapshot's removal, a server's stop); at exit, so does this
module.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ...config import Config
from ..container.cgroups import Layout
from ..state.store import Store
from .lifetime import SnapshotRecord
from .restoring import Ready, discard, prepare_one

log = logging.getLogger(__name__)

#: Snapshots one process keeps a clone ready for.
MAX_SNAPSHOTS = 8
#: How long ``release`` waits for a clone being made.
RELEASE_WAIT_S = 60.0
#: How long ``take`` waits for one (making one takes ~5 ms; a stuck one is not waited for).
TAKE_WAIT_S = 1.0


@dataclass
class _Wanted:
    cfg: Config
    snap: SnapshotRecord
    ready: Ready | None = None
    making: threading.Thread | None = None
    failures: int = 0


_lock = threading.Lock()
_wanted: OrderedDict[str, _Wanted] = OrderedDict()  # by snapshot id, the one wanted last at the end
#: A snapshot whose clone failed to be made this many times in a row gets none made ahead.
MAX_FAILURES = 3


def want(cfg: Config, snap: SnapshotRecord) -> None:
    """Keep a clone of ``snap`` ready (made now in the background if none is, or being made)."""
    dropped: list[_Wanted] = []
    with _lock:
        w = _wanted.get(snap.id)
        if w is None:
            w = _wanted[snap.id] = _Wanted(cfg, snap)
            while len(_wanted) > MAX_SNAPSHOTS:
                dropped.append(_wanted.popitem(last=False)[1])
        _wanted.move_to_end(snap.id)
        _fill(w)
    for old in dropped:
        _destroy(old)


def take(snap_id: str) -> Ready | None:
    """The ready clone of snapshot ``snap_id``, now the caller's (``restoring.restore``'s
    ``ready``), or None. One being made is waited for: it started before this call, so it
    is done sooner than a clone made anew. The next is made when the caller ``want``s it,
    after its restore: made during it, it would take the restore's CPU."""
    with _lock:
        w = _wanted.get(snap_id)
        making = None if w is None else w.making
    if w is None:
        return None
    if making is not None:
        making.join(TAKE_WAIT_S)
    with _lock:
        ready, w.ready = w.ready, None
        return ready


def wait(timeout: float = RELEASE_WAIT_S) -> None:
    """Until every clone being made is made (or failed); a benchmark's calls between runs."""
    with _lock:
        making = [w.making for w in _wanted.values() if w.making is not None]
    for t in making:
        t.join(timeout)


def release(snap_id: str | None = None) -> None:
    """Stop making clones of ``snap_id`` (None: of every snapshot) and destroy those made."""
    with _lock:
        gone = [_wanted.pop(k) for k in list(_wanted) if snap_id is None or k == snap_id]
    for w in gone:
        _destroy(w)


def _fill(w: _Wanted) -> None:
    """Start making ``w``'s next clone unless one is ready or being made (``_lock`` held)."""
    if w.ready is not None or w.making is not None or w.failures >= MAX_FAILURES:
        return
    w.making = threading.Thread(target=_make, args=(w,), name=f"bunshin-ahead-{w.snap.id}", daemon=True)
    w.making.start()


def _make(w: _Wanted) -> None:
    ready: Ready | None = None
    try:
        with Store.open(w.cfg.db_path) as store:
            ready = prepare_one(w.cfg, store, w.snap, Layout.discover(), ahead=True)
    except Exception as e:  # the restore that would have taken it makes its clone itself
        log.warning("making a clone of snapshot %s ahead failed: %s", w.snap.id, e)
    with _lock:
        w.making = None
        keep = ready is not None and _wanted.get(w.snap.id) is w
        if keep:
            w.ready, w.failures = ready, 0
        elif ready is None:
            w.failures += 1
    if ready is not None and not keep:  # released meanwhile
        _discard(w.cfg, w.snap, ready)


def _destroy(w: _Wanted) -> None:
    """Wait for ``w``'s clone being made (it then sees ``w`` gone and destroys it), destroy the ready one."""
    making = w.making
    if making is not None:
        making.join(RELEASE_WAIT_S)
    with _lock:
        ready, w.ready = w.ready, None
    if ready is not None:
        _discard(w.cfg, w.snap, ready)


def _discard(cfg: Config, snap: SnapshotRecord, ready: Ready) -> None:
    try:
        with Store.open(cfg.db_path) as store:
            discard(cfg, store, snap, ready.rec.id)
    except Exception as e:  # gc's then: its owner, this process, will be gone
        log.warning("removing clone %s made ahead failed: %s", ready.rec.id, e)


def _forget() -> None:
    """In a forked child: the clones made ahead are the parent's (their records name it as
    owner), never this process's to take or destroy."""
    global _lock
    _lock = threading.Lock()
    _wanted.clear()


atexit.register(release)
os.register_at_fork(after_in_child=_forget)
