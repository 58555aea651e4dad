"""Resumable calls: long ops run as jobs the host polls with short connections.

A host that holds a connection open into a workspace cannot let it be checkpointed
(CRIU refuses a unix socket whose peer is outside). So a long ``exec`` or
``session_run`` is started as a job (``job_start``) and its answer fetched by
``job_wait`` long-polls of at most a few seconds each. Between two polls no
connection is open, a fork can happen, and the job is forked with the agent:
each clone finishes it and keeps its own answer.

A job is a process of its own: the worker that serves ``job_start`` runs the
inner request in a thread and, once its connection has ended, answers ``job_wait``
on ``<helpers>/jobs/<id>.sock`` (a second job on the same connection gets a process
forked for it, ``bunshin-job``); once its answer is fetched (or after
``KEEP_FINISHED_S`` unfetched) it removes the socket and ends, and every page
the call wrote ends with it.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from . import forks
from .pool import Flag, Pool
from .protocol import AgentFailure, arg_any, arg_str, cannot_start, failure, invalid, parse_request
from .wire import (
    JOB_ID,
    JOB_REQUEST,
    JOB_RUNNING,
    JOB_WAIT,
    MAX_WAIT_S,
    OP,
    RESUMABLE_OPS,
    ErrorCode,
    LineReader,
    Op,
    ok_line,
    request_line,
)

KEEP_FINISHED_S = 600.0  # answers nobody fetched are dropped after this
#: How the agent serves calls: a worker process forked per connection (jobs and
#: sessions in processes of their own), or on the agent's pool threads (``pool``).
CALLS = ("fork", "thread")
_JOB_ID = re.compile(r"[0-9a-f]{16}")


class Jobs:
    """Starts job processes in ``folder``; ``answer(request)`` gives a request's answer line."""

    def __init__(self, folder: str, answer: Callable[[dict[str, Any]], bytes]) -> None:
        self._folder = folder
        self._answer = answer
        #: Set in a worker: its first job runs in the worker itself, which serves that
        #: job's ``job_wait`` once its connection has ended (one fork less per call).
        self.adopt = False
        self.adopted: _Job | None = None

    def _socket(self, job_id: str) -> str:
        return os.path.join(self._folder, f"{job_id}.sock")

    def start(self, req: dict[str, Any]) -> bytes:
        inner = arg_any(req, JOB_REQUEST)
        if not isinstance(inner, dict) or inner.get(OP) not in RESUMABLE_OPS:
            raise invalid(f'"{JOB_REQUEST}" must be an object whose op is one of {", ".join(RESUMABLE_OPS)}')
        job_id = os.urandom(8).hex()
        os.makedirs(self._folder, mode=0o700, exist_ok=True)
        path = self._socket(job_id)
        listen = forks.listen_at(path)  # before the answer: a job_wait may come at once
        if self.adopt and self.adopted is None:
            self.adopted = _Job(listen, path, inner, self._answer)
            self.adopted.start()
            return ok_line({JOB_ID: job_id})
        try:
            pid = forks.fork(forks.JOB)
        except OSError as exc:
            listen.close()
            os.unlink(path)
            raise cannot_start("a job", exc) from None
        if pid == 0:
            forks.keep_only(listen.fileno())
            job = _Job(listen, path, inner, self._answer)
            job.start()
            forks.run_and_exit(job.serve)
        listen.close()
        return ok_line({JOB_ID: job_id})

    def wait(self, req: dict[str, Any]) -> bytes:
        job_id = arg_str(req, JOB_ID)
        wait = arg_any(req, JOB_WAIT) if JOB_WAIT in req else 1.0
        if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
            raise invalid(f'argument "{JOB_WAIT}" must be a non-negative number')
        gone = AgentFailure(ErrorCode.NOT_FOUND, f"no job {job_id!r} (finished and fetched, or never started)")
        if not _JOB_ID.fullmatch(job_id):
            raise gone
        line = request_line(Op.JOB_WAIT, {JOB_ID: job_id, JOB_WAIT: min(float(wait), MAX_WAIT_S)})
        path = self._socket(job_id)
        try:
            return forks.ask(path, line, MAX_WAIT_S + 30.0)
        except FileNotFoundError:
            raise gone from None
        except ConnectionRefusedError:  # its socket is there, its process is not
            try:
                os.unlink(path)
            except OSError:
                pass
            raise AgentFailure(ErrorCode.AGENT_ERROR, f"job {job_id} ended without an answer: its process "
                               "was killed (from inside the workspace?)") from None
        except OSError as exc:
            raise AgentFailure(ErrorCode.AGENT_ERROR, f"job {job_id}: {exc}") from None


class _Job:
    """The job process: the inner request in a thread, ``job_wait`` answered here."""

    def __init__(self, listen: socket.socket, path: str, inner: dict[str, Any],
                 answer: Callable[[dict[str, Any]], bytes]) -> None:
        self.listen = listen
        self.path = path
        self.done = threading.Event()
        self.answer = b""
        self._thread = threading.Thread(target=self._run, args=(inner, answer), name="job", daemon=True)

    def _run(self, inner: dict[str, Any], answer: Callable[[dict[str, Any]], bytes]) -> None:
        try:
            self.answer = answer(inner)
        finally:
            self.done.set()

    def start(self) -> None:
        self._thread.start()

    def serve(self) -> None:
        """Answer ``job_wait`` until the answer is fetched (or kept too long unfetched)."""
        finished_at: float | None = None
        while True:
            if finished_at is None and self.done.is_set():
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > KEEP_FINISHED_S:
                break
            self.listen.settimeout(MAX_WAIT_S if finished_at is None else KEEP_FINISHED_S)
            try:
                conn, _ = self.listen.accept()
            except TimeoutError:
                continue
            with conn:
                if self._answer(conn):
                    break
        os.unlink(self.path)

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one ``job_wait``; True once the job's answer went out."""
        conn.settimeout(10.0)
        try:
            line = LineReader(conn.recv).readline()
            if line is None:
                return False
            req = parse_request(line)
            wait = req.get(JOB_WAIT)
            if not isinstance(wait, int | float):
                raise invalid(f'argument "{JOB_WAIT}" must be a number')
        except AgentFailure as exc:
            _send(conn, failure(exc))
            return False
        except (OSError, ValueError):
            return False
        if not self.done.wait(min(float(wait), MAX_WAIT_S)):
            _send(conn, ok_line({JOB_RUNNING: True}))
            return False
        return _send(conn, self.answer)


def _send(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False


class _ThreadJob:
    def __init__(self) -> None:
        self.done = Flag()
        self.answer = b""
        self.finished_at = 0.0


class ThreadJobs:
    """Jobs as threads of the agent itself (``--calls thread``): no fork on the call's path,
    but every page a call writes is the agent's (in a clone: copied from the snapshot)."""

    def __init__(self, answer: Callable[[dict[str, Any]], bytes], pool: Pool) -> None:
        self._answer = answer
        self._pool = pool
        self._jobs: dict[str, _ThreadJob] = {}
        self._lock = threading.Lock()

    def start(self, req: dict[str, Any]) -> bytes:
        inner = arg_any(req, JOB_REQUEST)
        if not isinstance(inner, dict) or inner.get(OP) not in RESUMABLE_OPS:
            raise invalid(f'"{JOB_REQUEST}" must be an object whose op is one of {", ".join(RESUMABLE_OPS)}')
        job_id = os.urandom(8).hex()
        job = _ThreadJob()
        with self._lock:
            now = time.monotonic()
            for old_id, old in list(self._jobs.items()):
                if old.done.is_set() and now - old.finished_at > KEEP_FINISHED_S:
                    del self._jobs[old_id]
            self._jobs[job_id] = job
        try:
            self._pool.submit(self._run, job, inner)
        except RuntimeError as exc:  # no thread left (pids limit)
            with self._lock:
                self._jobs.pop(job_id, None)
            raise cannot_start("a job", exc) from None
        return ok_line({JOB_ID: job_id})

    def _run(self, job: _ThreadJob, inner: dict[str, Any]) -> None:
        try:
            job.answer = self._answer(inner)
        finally:
            job.finished_at = time.monotonic()
            job.done.set()

    def wait(self, req: dict[str, Any]) -> bytes:
        job_id = arg_str(req, JOB_ID)
        wait = arg_any(req, JOB_WAIT) if JOB_WAIT in req else 1.0
        if not isinstance(wait, int | float) or isinstance(wait, bool) or wait < 0:
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
