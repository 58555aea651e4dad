"""State on disk: one SQLite database under the state folder.

Every CLI invocation opens it anew, so records are the only memory bunshin has
across processes. WAL mode and a busy timeout let concurrent invocations share it.
A process keeps the connections it closed (a few per database file) and opens the
next ``Store`` on one of them: a new connection's first statement maps the WAL index
and reads the schema (~1 ms; a server's sandbox create opened six). A kept connection
sees every other process's writes as a new one does (SQLite checks the WAL index at
each statement); it is kept only for the same file (device and inode: a database
removed and made anew at the path gets new connections), never in a forked child.
A record is changed by reading it, changing it and writing it back inside one
``transaction`` (``update_workspace``, ``update_object``): ``BEGIN IMMEDIATE`` takes
the database's write lock before the read, so two processes never interleave and
neither loses the other's change.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ...errors import InvalidArgument, WorkspaceNotFound
from .records import MADE_AHEAD, WorkspaceRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workspaces (
    id TEXT PRIMARY KEY,
    name TEXT UNIQUE,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    id TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (kind, id)
);
"""


#: Closed connections kept per database file, and in all, at most.
IDLE_PER_FILE, IDLE_MAX = 4, 16
_FileKey = tuple[str, int, int]  # path, device, inode


class _Idle:
    """The connections this process closed, per database file, ready for the next ``open``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_file: dict[_FileKey, list[sqlite3.Connection]] = {}
        self._inherited: list[sqlite3.Connection] = []  # a forked child's copies: never used, never closed

    def take(self, key: _FileKey) -> sqlite3.Connection | None:
        with self._lock:
            stale = [k for k in self._by_file if k[0] == key[0] and k != key]  # that path's earlier file
            old = [c for k in stale for c in self._by_file.pop(k)]
            kept = self._by_file.get(key)
            conn = kept.pop() if kept else None
        for c in old:
            c.close()
        return conn

    def give(self, key: _FileKey, conn: sqlite3.Connection) -> bool:
        """Keep ``conn`` for ``key``'s next open; False if there are enough already. Past
        ``IDLE_MAX`` in all, those of the file used longest ago are closed (a process that
        went through many homes, as a test run does, keeps a few connections, not all)."""
        with self._lock:
            kept = self._by_file.pop(key, [])
            self._by_file[key] = kept  # the last used file last
            if len(kept) >= IDLE_PER_FILE:
                return False
            kept.append(conn)
            old: list[sqlite3.Connection] = []
            while sum(len(v) for v in self._by_file.values()) > IDLE_MAX:
                first = next(iter(self._by_file))
                old.append(self._by_file[first].pop(0))
                if not self._by_file[first]:
                    del self._by_file[first]
        for c in old:
            c.close()
        return True

    def release(self, path: Path | None = None) -> int:
        """Close the kept connections of the database at ``path`` (all, if None); how many."""
        with self._lock:
            keys = [k for k in self._by_file if path is None or k[0] == str(path)]
            old = [c for k in keys for c in self._by_file.pop(k)]
        for c in old:
            c.close()
        return len(old)

    def forked(self) -> None:
        """In a forked child: its copies of the parent's connections are the parent's (using
        or closing one there could break the database); set aside, kept out of reach."""
        self._inherited += [c for kept in self._by_file.values() for c in kept]
        self._by_file = {}
        self._lock = threading.Lock()


_idle = _Idle()
os.register_at_fork(after_in_child=_idle.forked)
_CLOSED = sqlite3.connect(":memory:", check_same_thread=False)
_CLOSED.close()  # a closed store's connection: any use raises, as on a closed connection


def release_kept(path: Path | None = None) -> int:
    """Close the connections this process keeps for the database at ``path`` (every
    database's, if None), e.g. before unmounting the file system that holds it (a kept
    connection holds the file open); how many were closed."""
    return _idle.release(path)


def _file_key(path: Path) -> _FileKey | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (str(path), st.st_dev, st.st_ino)


class Store:
    """The SQLite store. Open with :meth:`open`; use as a context manager or call close()."""

    def __init__(self, conn: sqlite3.Connection, key: _FileKey | None = None) -> None:
        self._conn = conn
        self._key = key  # the file the connection is of: kept for it on close
        # The connection is shared by threads (a fork's restores): a transaction holds
        # it for its thread, so another thread's statements never land inside it.
        self._lock = threading.RLock()
        self._depth = 0

    @classmethod
    def open(cls, path: Path) -> Store:
        key = _file_key(path)
        conn = _idle.take(key) if key is not None else None
        if conn is not None:
            return cls(conn, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        return cls(conn, _file_key(path))

    def close(self) -> None:
        """Done with it: its connection is kept for this process's next ``open`` of the file
        (closed if enough are kept, or a transaction is somehow still open)."""
        conn, self._conn = self._conn, _CLOSED
        if conn is _CLOSED:
            return
        if self._key is None or conn.in_transaction or not _idle.give(self._key, conn):
            conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All or nothing, and no other writer in between (``BEGIN IMMEDIATE``: the write
        lock is taken at once, waiting up to the busy timeout). A nested call joins the
        outer transaction."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self._conn.execute("ROLLBACK")
                raise
            self._depth = 0
            self._conn.execute("COMMIT")

    def _execute(self, sql: str, params: tuple[object, ...] = ()) -> None:
        with self._lock:
            self._conn.execute(sql, params)

    def _rows(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[str, ...]]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    # workspaces ------------------------------------------------------------------

    def add_workspace(self, rec: WorkspaceRecord) -> None:
        try:
            self._execute(
                "INSERT INTO workspaces (id, name, state, created_at, data) VALUES (?, ?, ?, ?, ?)",
                (rec.id, rec.name, rec.state.value, rec.created_at, rec.to_json()),
            )
        except sqlite3.IntegrityError:
            raise InvalidArgument(
                f"a workspace named {rec.name!r} already exists", hint="pick another --name or remove it first"
            ) from None

    def save_workspace(self, rec: WorkspaceRecord) -> None:
        self._execute(
            "UPDATE workspaces SET name = ?, state = ?, data = ? WHERE id = ?",
            (rec.name, rec.state.value, rec.to_json(), rec.id),
        )

    def update_workspace(
        self, ws_id: str, change: Callable[[WorkspaceRecord], WorkspaceRecord]
    ) -> WorkspaceRecord | None:
        """Read the workspace ``ws_id``, ``change`` it and write it back, in one transaction;
        the new record, or None (and nothing written) if there is none."""
        with self.transaction():
            rows = self._rows("SELECT data FROM workspaces WHERE id = ?", (ws_id,))
            if not rows:
                return None
            rec = change(WorkspaceRecord.from_json(rows[0][0]))
            self.save_workspace(rec)
            return rec

    def get_workspace(self, ref: str) -> WorkspaceRecord:
        """By id, unique id prefix, or name."""
        rows = self._rows("SELECT data FROM workspaces WHERE id = ? OR name = ?", (ref, ref))
        if not rows:
            rows = self._rows(
                "SELECT data FROM workspaces WHERE id LIKE ? ESCAPE '\\'",
                (ref.replace("%", "\\%").replace("_", "\\_") + "%",),
            )
            if len(rows) > 1:
                raise InvalidArgument(f"{ref!r} matches {len(rows)} workspaces", hint="give more of the id")
        if not rows:
            raise WorkspaceNotFound(f"no workspace {ref!r}", hint="`bunshin ls` lists the workspaces")
        return WorkspaceRecord.from_json(rows[0][0])

    def live_pids_limits(self) -> list[int | None]:
        """The pids limit of every workspace not dead, made-ahead clones included (``budget``)."""
        return [p for _, p in self.live_limits(made_ahead=True)]

    def live_limits(self, *, made_ahead: bool = False) -> list[tuple[int | None, int | None]]:
        """(memory limit, pids limit) of every workspace not dead, and not made ahead of its
        restore (``MADE_AHEAD``) unless ``made_ahead``, read in SQL: no record is parsed (the
        server's caps, at each create: 1,000 records parsed took ~40 ms)."""
        rows = self._rows("SELECT json_extract(data, '$.memory_limit'), json_extract(data, '$.pids_limit') "
                          "FROM workspaces WHERE state != 'dead' AND (? OR json_extract(data, ?) IS NOT 1)",
                          (made_ahead, f"$.extra.{MADE_AHEAD}"))
        return [(None if m is None else int(m), None if p is None else int(p)) for m, p in rows]

    def list_workspaces(self) -> list[WorkspaceRecord]:
        rows = self._rows("SELECT data FROM workspaces ORDER BY created_at")
        return [WorkspaceRecord.from_json(r[0]) for r in rows]

    def delete_workspace(self, ws_id: str) -> None:
        self._execute("DELETE FROM workspaces WHERE id = ?", (ws_id,))

    # other objects (snapshots, layers, memory files) ---------------------------

    def put_object(self, kind: str, obj_id: str, data: str) -> None:
        self._execute(
            "INSERT OR REPLACE INTO objects (kind, id, data) VALUES (?, ?, ?)", (kind, obj_id, data)
        )

    def insert_object(self, kind: str, obj_id: str, data: str) -> None:
        """Add an object; ``sqlite3.IntegrityError`` if one of that kind and id exists."""
        self._execute("INSERT INTO objects (kind, id, data) VALUES (?, ?, ?)", (kind, obj_id, data))

    def get_object(self, kind: str, obj_id: str) -> str | None:
        rows = self._rows("SELECT data FROM objects WHERE kind = ? AND id = ?", (kind, obj_id))
        return rows[0][0] if rows else None

    def update_object(self, kind: str, obj_id: str, change: Callable[[str], str]) -> str | None:
        """Read an object, ``change`` its data and write it back, in one transaction; the
        new data, or None (and nothing written) if there is none."""
        with self.transaction():
            data = self.get_object(kind, obj_id)
            if data is None:
                return None
            new = change(data)
            self.put_object(kind, obj_id, new)
            return new

    def list_objects(self, kind: str) -> list[tuple[str, str]]:
        return [(r[0], r[1]) for r in self._rows("SELECT id, data FROM objects WHERE kind = ? ORDER BY id", (kind,))]

    def delete_object(self, kind: str, obj_id: str) -> None:
        self._execute("DELETE FROM objects WHERE kind = ? AND id = ?", (kind, obj_id))

    def sum_objects(self, kind: str, fields: Sequence[str], *, where: str) -> int:
        """The sum of the number ``fields`` of the objects of ``kind`` whose ``where`` field is
        true, read in SQL (nothing is parsed here)."""
        if not all(f.isidentifier() for f in (*fields, where)):
            raise ValueError(f"not field names: {fields!r}, {where!r}")
        total = " + ".join(f"COALESCE(json_extract(data, '$.{f}'), 0)" for f in fields)
        rows = self._rows(f"SELECT SUM({total}) FROM objects WHERE kind = ? AND json_extract(data, ?) = 1",
                          (kind, f"$.{where}"))
        return int(rows[0][0] or 0)

    def expire_objects(self, kind: str, field: str, before: float) -> None:
        """Delete the objects of ``kind`` whose JSON data has a number ``field`` below
        ``before`` (one statement: SQLite reads the field, nothing is parsed here)."""
        if not field.isidentifier():
            raise ValueError(f"not a field name: {field!r}")
        self._execute("DELETE FROM objects WHERE kind = ? AND json_extract(data, ?) < ?",
                      (kind, f"$.{field}", before))
