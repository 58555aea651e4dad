"""State on disk: one SQLite database under the state folder.

Every CLI invocation opens it anew, so records are the only memory bunshin has
across processes. WAL mode and a busy timeout let concurrent invocations share it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import InvalidArgument, WorkspaceNotFound
from .records import WorkspaceRecord

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


class Store:
    """The SQLite store. Open with :meth:`open`; use as a context manager or call close()."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    @classmethod
    def open(cls, path: Path) -> Store:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        return cls(conn)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # workspaces ------------------------------------------------------------------

    def add_workspace(self, rec: WorkspaceRecord) -> None:
        try:
            self._conn.execute(
                "INSERT INTO workspaces (id, name, state, created_at, data) VALUES (?, ?, ?, ?, ?)",
                (rec.id, rec.name, rec.state.value, rec.created_at, rec.to_json()),
            )
        except sqlite3.IntegrityError:
            raise InvalidArgument(
                f"a workspace named {rec.name!r} already exists", hint="pick another --name or remove it first"
            ) from None

    def save_workspace(self, rec: WorkspaceRecord) -> None:
        self._conn.execute(
            "UPDATE workspaces SET name = ?, state = ?, data = ? WHERE id = ?",
            (rec.name, rec.state.value, rec.to_json(), rec.id),
        )

    def get_workspace(self, ref: str) -> WorkspaceRecord:
        """By id, unique id prefix, or name."""
        rows = self._conn.execute(
            "SELECT data FROM workspaces WHERE id = ? OR name = ?", (ref, ref)
        ).fetchall()
        if not rows:
            rows = self._conn.execute(
                "SELECT data FROM workspaces WHERE id LIKE ? ESCAPE '\\'",
                (ref.replace("%", "\\%").replace("_", "\\_") + "%",),
            ).fetchall()
            if len(rows) > 1:
                raise InvalidArgument(f"{ref!r} matches {len(rows)} workspaces", hint="give more of the id")
        if not rows:
            raise WorkspaceNotFound(f"no workspace {ref!r}", hint="`bunshin ls` lists the workspaces")
        return WorkspaceRecord.from_json(rows[0][0])

    def list_workspaces(self) -> list[WorkspaceRecord]:
        rows = self._conn.execute("SELECT data FROM workspaces ORDER BY created_at").fetchall()
        return [WorkspaceRecord.from_json(r[0]) for r in rows]

    def delete_workspace(self, ws_id: str) -> None:
        self._conn.execute("DELETE FROM workspaces WHERE id = ?", (ws_id,))

    # other objects (snapshots, layers, memory files) ---------------------------

    def put_object(self, kind: str, obj_id: str, data: str) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO objects (kind, id, data) VALUES (?, ?, ?)", (kind, obj_id, data)
        )

    def get_object(self, kind: str, obj_id: str) -> str | None:
        row = self._conn.execute(
            "SELECT data FROM objects WHERE kind = ? AND id = ?", (kind, obj_id)
        ).fetchone()
        return row[0] if row else None

    def list_objects(self, kind: str) -> list[tuple[str, str]]:
        return list(self._conn.execute("SELECT id, data FROM objects WHERE kind = ? ORDER BY id", (kind,)))

    def delete_object(self, kind: str, obj_id: str) -> None:
        self._conn.execute("DELETE FROM objects WHERE kind = ? AND id = ?", (kind, obj_id))
