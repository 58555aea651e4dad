"""Idempotent mutations: a retried create, fork, snapshot or restore makes nothing twice.

A mutating call may carry ``Idempotency-Key: <key>`` (or ``X-Request-ID``). The first
call with a key claims it in the SQLite store (``objects`` of kind ``idempotency``,
written before any work, like every record bunshin keeps), runs, and stores its
answer if it succeeded. Every later call with the same key gets that answer back,
marked ``Idempotent-Replayed: true``, for 24 hours, also from a restarted server. The rules follow Stripe and the IETF draft
``draft-ietf-httpapi-idempotency-key-header``:

- the same key with another request (method, path or validated body) is
  :class:`~bunshin.errors.IdempotencyKeyReused`, 422;
- the same key while the first call still runs is
  :class:`~bunshin.errors.RequestInProgress`, 409 with ``Retry-After``: the caller
  retries and then gets the first call's answer (waiting in the server would hold a
  thread per impatient client; Stripe answers 409 too);
- a call that failed stores nothing: its key is released and a retry runs anew. A
  failed create, fork, snapshot or restore made nothing (admission refusals did no
  work; the runtime's batches are all or none), so there is no answer to keep, and a
  retry after the cause is gone (a cap freed, a workspace started) must not be told
  the old error for a day;
- a claim left ``running`` by a server that has since stopped (kill -9 mid-fork)
  is taken over: that call answered nobody, and its half-made workspaces are
  ``bunshin gc``'s (the runtime's batches are all or none).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from fastapi import Depends, Header
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..config import Config
from ..errors import IdempotencyKeyReused, RequestInProgress
from ..runtime.state.store import Store

KIND = "idempotency"
#: How long an answer is kept for retries.
TTL_S = 24 * 3600.0
#: How often expired answers are swept (on the next claim after this many seconds).
SWEEP_EVERY_S = 600.0
#: What a caller is told to wait while the first call with its key runs.
IN_PROGRESS_RETRY_S = 1
MAX_KEY = 255

KeyHeader = Annotated[str | None, Header(alias="Idempotency-Key", max_length=MAX_KEY,
                                         description="retries with the same key get the first answer")]
RequestIdHeader = Annotated[str | None, Header(alias="X-Request-ID", max_length=MAX_KEY,
                                               description="used as the Idempotency-Key if that is absent")]


@dataclass(frozen=True)
class Entry:
    """A key's record: what was asked (``fingerprint``), by which server run (``owner``),
    and, once done, the answer."""

    fingerprint: str
    owner: str
    created_at: float
    status: int | None = None
    body: Any = None

    @property
    def done(self) -> bool:
        return self.status is not None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Entry:
        return cls(**json.loads(text))


def fingerprint(method: str, path: str, req: BaseModel | None) -> str:
    """The request as validated (defaults filled in), so ``{}`` and ``{"count": 1}`` agree."""
    body = req.model_dump_json() if req is not None else ""
    return hashlib.sha256(f"{method} {path}\n{body}".encode()).hexdigest()


class Idempotency:
    """The keys of one server run, kept in ``config``'s store."""

    def __init__(self, config: Config, *, ttl_s: float = TTL_S) -> None:
        self._config = config
        self._ttl_s = ttl_s
        self._owner = uuid.uuid4().hex  # this server run: claims of earlier runs are stale
        self._swept_at = 0.0
        self._sweep_lock = threading.Lock()

    def run(self, key: str | None, method: str, path: str, req: BaseModel | None, status: int,
            fn: Callable[[], Any]) -> JSONResponse:
        """``fn()``'s answer with ``status``, once per ``key`` (no key: every time)."""
        if key is None:
            return JSONResponse(jsonable_encoder(fn()), status_code=status)
        fp = fingerprint(method, path, req)
        prior = self._claim(key, fp)
        if prior is not None:
            return JSONResponse(prior.body, status_code=prior.status or 200,
                                headers={"Idempotent-Replayed": "true"})
        try:
            body = jsonable_encoder(fn())
        except BaseException:
            self._release(key)
            raise
        self._finish(key, fp, status, body)
        return JSONResponse(body, status_code=status)

    def _claim(self, key: str, fp: str) -> Entry | None:
        """None: the key is ours now, run the call; else the finished entry to replay."""
        self._sweep()
        now = time.time()
        with Store.open(self._config.db_path) as store, store.transaction():
            raw = store.get_object(KIND, key)
            old = Entry.from_json(raw) if raw is not None else None
            if old is not None and now - old.created_at > self._ttl_s:
                old = None
            if old is not None and old.fingerprint != fp:
                raise IdempotencyKeyReused(
                    f"Idempotency-Key {key!r} was used for another request",
                    hint="use a new key for each logical call; a retry sends the same method, path and body")
            if old is not None and old.done:
                return old
            if old is not None and old.owner == self._owner:
                raise RequestInProgress(f"the call with Idempotency-Key {key!r} is still running",
                                        hint=f"retry in {IN_PROGRESS_RETRY_S} s to get its answer",
                                        retry_after=IN_PROGRESS_RETRY_S)
            store.put_object(KIND, key, Entry(fp, self._owner, now).to_json())
            return None

    def _finish(self, key: str, fp: str, status: int, body: Any) -> None:
        with Store.open(self._config.db_path) as store:
            store.put_object(KIND, key, Entry(fp, self._owner, time.time(), status, body).to_json())

    def _release(self, key: str) -> None:
        with Store.open(self._config.db_path) as store:
            store.delete_object(KIND, key)

    def _sweep(self) -> None:
        now = time.time()
        with self._sweep_lock:
            if now - self._swept_at < SWEEP_EVERY_S:
                return
            self._swept_at = now
        with Store.open(self._config.db_path) as store:
            store.expire_objects(KIND, "created_at", now - self._ttl_s)


def _key(idempotency_key: KeyHeader = None, request_id: RequestIdHeader = None) -> str | None:
    return idempotency_key or request_id or None


#: A route's idempotency key: ``Idempotency-Key``, else ``X-Request-ID``, else None.
IdemKey = Annotated[str | None, Depends(_key)]
