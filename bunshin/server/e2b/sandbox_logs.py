"""A sandbox's logs, as E2B's ``GET /sandboxes/{id}/logs`` and ``/v2/sandboxes/{id}/logs``
show them: what the server did to it and in it.

The server records each sandbox's lifecycle (created from a template, forked from another or
into others, paused, resumed, timeout set, killed, removed when its timeout ran out) and envd's processes (started, ended
with their status or a signal, signalled, killed at their timeout) as structured entries:
a time, a level (``debug`` < ``info`` < ``warn`` < ``error``), a message and string fields.
They are kept in the server's memory, a ring per sandbox: at most :data:`MAX_ENTRIES`
entries and :data:`MAX_BYTES` bytes each (the oldest go first), and :data:`MAX_SANDBOXES`
rings (the least recently written goes first); a killed sandbox's ring stays readable
until it is pushed out so. A restarted server starts with none. Times are whole
milliseconds, strictly increasing within a sandbox, so a cursor (a time) names one entry.
"""

from __future__ import annotations

import enum
import json
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..context import ServerContext

#: Entries and bytes (messages and fields) of one sandbox's ring; sandboxes with a ring.
MAX_ENTRIES = 1000
MAX_BYTES = 64 << 10
MAX_SANDBOXES = 1024
#: Characters of a message and of a field's value (longer ones are cut, marked with "…").
MAX_MESSAGE = 1024
MAX_FIELD = 256


class Level(enum.IntEnum):
    """E2B's ``LogLevel``, ordered: a query's ``level`` is the least it shows."""

    DEBUG = 0
    INFO = 1
    WARN = 2
    ERROR = 3

    @property
    def wire(self) -> str:
        return self.name.lower()

    @classmethod
    def of(cls, text: str) -> Level:
        return cls[text.upper()]


@dataclass(frozen=True)
class Entry:
    """One log entry; ``ms``: milliseconds since the epoch."""

    ms: int
    level: Level
    message: str
    fields: tuple[tuple[str, str], ...]

    @property
    def size(self) -> int:
        return len(self.message) + sum(len(k) + len(v) for k, v in self.fields) + 16

    def to_entry(self) -> dict[str, Any]:
        """E2B's ``SandboxLogEntry``."""
        return {"timestamp": iso(self.ms), "level": self.level.wire, "message": self.message,
                "fields": dict(self.fields)}

    def to_line(self) -> dict[str, Any]:
        """E2B's v1 ``SandboxLog``: the entry as one JSON line."""
        line = json.dumps({"level": self.level.wire, "message": self.message, **dict(self.fields)})
        return {"timestamp": iso(self.ms), "line": line}


def iso(ms: int) -> str:
    """Milliseconds since the epoch as RFC 3339 (E2B's times; envd imports this module, so
    not ``shapes.iso``, which imports envd)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[:most - 1] + "…"


class _Ring:
    def __init__(self) -> None:
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.last_ms = 0

    def add(self, level: Level, message: str, fields: dict[str, object]) -> None:
        self.last_ms = max(int(time.time() * 1000), self.last_ms + 1)
        kept = tuple((_cut(k, 64), _cut(str(v), MAX_FIELD)) for k, v in list(fields.items())[:16])
        e = Entry(self.last_ms, level, _cut(message, MAX_MESSAGE), kept)
        self.entries.append(e)
        self.bytes += e.size
        while len(self.entries) > MAX_ENTRIES or self.bytes > MAX_BYTES:
            self.bytes -= self.entries.popleft().size


class SandboxLogs:
    """The rings of one server (thread-safe: routes run in the server's thread pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rings: OrderedDict[str, _Ring] = OrderedDict()  # least recently written first

    def record(self, sandbox_id: str, level: Level, message: str, **fields: object) -> None:
        with self._lock:
            ring = self._rings.get(sandbox_id)
            if ring is None:
                ring = self._rings[sandbox_id] = _Ring()
                while len(self._rings) > MAX_SANDBOXES:
                    self._rings.popitem(last=False)
            else:
                self._rings.move_to_end(sandbox_id)
            ring.add(level, message, {"sandboxID": sandbox_id, **fields})

    def info(self, sandbox_id: str, message: str, **fields: object) -> None:
        self.record(sandbox_id, Level.INFO, message, **fields)

    def has(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._rings

    def entries(self, sandbox_id: str) -> list[Entry]:
        """The entries kept of ``sandbox_id``, oldest first (none: an empty list)."""
        with self._lock:
            ring = self._rings.get(sandbox_id)
            return list(ring.entries) if ring is not None else []


def select(entries: list[Entry], *, cursor: int | None, limit: int, forward: bool,
           level: Level = Level.DEBUG, search: str | None = None) -> list[Entry]:
    """E2B's v2 query: entries at ``level`` or above whose message holds ``search`` (case
    sensitive); forward: from ``cursor`` (ms, inclusive; default the first) oldest first,
    backward: up to ``cursor`` (default now) newest first; at most ``limit``."""
    chosen = [e for e in entries if e.level >= level and (not search or search in e.message)]
    if forward:
        out = [e for e in chosen if cursor is None or e.ms >= cursor]
    else:
        out = [e for e in reversed(chosen) if cursor is None or e.ms <= cursor]
    return out[:limit]


_BY_SERVER: weakref.WeakKeyDictionary[ServerContext, SandboxLogs] = weakref.WeakKeyDictionary()
_BY_SERVER_LOCK = threading.Lock()


def logs_of(ctx: ServerContext) -> SandboxLogs:
    """The logs of the server of ``ctx`` (made on first use)."""
    with _BY_SERVER_LOCK:
        logs = _BY_SERVER.get(ctx)
        if logs is None:
            logs = _BY_SERVER[ctx] = SandboxLogs()
        return logs


def timed_out(ctx: ServerContext, ws_ids: list[str]) -> None:
    """Note in their logs that the sandboxes among ``ws_ids`` (workspaces the lease sweep
    found expired) were removed: those with logs and no lease left (a failed removal keeps
    its lease and is tried again)."""
    logs = logs_of(ctx)
    for ws_id in ws_ids:
        if logs.has(ws_id) and ctx.leases.get(ws_id) is None:
            logs.info(ws_id, "sandbox killed: its timeout ran out", event="expired")
