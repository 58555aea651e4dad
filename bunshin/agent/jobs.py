"""Resumable calls: long ops run as jobs the host polls with short connections.

A host that holds a connection open into a workspace cannot let it be checkpointed
(CRIU refuses a unix socket whose peer is outside). So a long ``exec`` or
``session_run`` is started as a job (``job_start``) and its answer fetched by
``job_wait`` long-polls of at most a few seconds each. Between two polls no
connection is open, a fork can happen, and the job (its thread, its child, its
session) is forked with the agent: each clone finishes it and keeps its own answer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .protocol import AgentFailure, arg_any, arg_str, invalid
from .wire import (
    JOB_ID,
    JOB_REQUEST,
    JOB_RUNNING,
    JOB_WAIT,
    MAX_WAIT_S,
    OP,
    RESUMABLE_OPS,
    ErrorCode,
    ok_line,
)

KEEP_FINISHED_S = 600.0  # answers nobody fetched are dropped after this


class _Job:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer = b""
        self.finished_at = 0.0


class Jobs:
    """Runs requests in threads; ``answer(line)`` is the server's request->reply function."""

    def __init__(self, answer: Callable[[dict[str, Any]], bytes]) -> None:
        self._answer = answer
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def start(self, req: dict[str, Any]) -> bytes:
        inner = arg_any(req, JOB_REQUEST)
        if not isinstance(inner, dict) or inner.get(OP) not in RESUMABLE_OPS:
            raise invalid(f'"{JOB_REQUEST}" must be an object whose op is one of {", ".join(RESUMABLE_OPS)}')
        job_id = os.urandom(8).hex()
        job = _Job()
        with self._lock:
            self._forget_old()
            self._jobs[job_id] = job
        threading.Thread(target=self._run, args=(job, inner), name=f"job-{job_id}", daemon=True).start()
        return ok_line({JOB_ID: job_id})

    def _run(self, job: _Job, inner: dict[str, Any]) -> None:
        try:
            job.answer = self._answer(inner)
        finally:
            job.finished_at = time.monotonic()
            job.done.set()

    def wait(self, req: dict[str, Any]) -> bytes:
        job_id = arg_str(req, JOB_ID)
        wait = arg_any(req, JOB_WAIT) if JOB_WAIT in req else 1.0
        if not isinstance(wait, int | float) or wait < 0:
            raise invalid(f'argument "{JOB_WAIT}" must be a non-negative number')
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise AgentFailure(ErrorCode.NOT_FOUND, f"no job {job_id!r} (finished and fetched, or never started)")
        if not job.done.wait(min(float(wait), MAX_WAIT_S)):
            return ok_line({JOB_RUNNING: True})
        with self._lock:
            self._jobs.pop(job_id, None)
        return job.answer

    def _forget_old(self) -> None:
        now = time.monotonic()
        for job_id, job in list(self._jobs.items()):
            if job.done.is_set() and now - job.finished_at > KEEP_FINISHED_S:
                del self._jobs[job_id]
