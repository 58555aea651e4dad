"""The agent's state, its op table, and the unix socket server.

Two ways to serve calls (``--calls``, ``jobs.CALLS``):

- ``thread`` (the default): connections and jobs on the pool's threads, which wait between
  calls and end before a fork (``pool``, ``trim``: none is dumped). No fork on a call's path;
  in a clone every page a call writes is the agent's (copied from the snapshot): ~0.8 MiB
  after a clone's first exec and tool call on Python 3.12 (``immortal``), ~1.9 MiB on 3.11.
- ``fork``: the long-lived agent only accepts; each connection is served by a worker
  forked for it (``bunshin-worker``), which answers its requests and ends with it (it
  runs a job it starts itself, ``jobs``). In a clone what a call writes is copied into
  a process that ends with the call, not into the agent: ~0.5 MiB after a clone's first
  exec and tool call. Each call pays the worker's copy-on-write faults instead
  (~500 for a ping), milliseconds of CPU.

Sessions: ``thread`` keeps them in the agent (``threadsessions``), ``fork`` in a process
of their own each (``sessions``: a holder that lends the pty).
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import execs, files, forks, procfs
from .children import Reaper
from .jobs import CALLS, Jobs, ThreadJobs
from .pool import Pool
from .protocol import (
    AgentFailure,
    arg_any,
    cannot_start,
    checked,
    failure,
    invalid,
    parse_request,
    unix_address,
)
from .sessions import Sessions
from .terminals import Attachment
from .threadsessions import ThreadSessions
from .wire import (
    JOB_ID,
    JOB_REQUEST,
    JOB_WAIT,
    OP,
    VERSION,
    ErrorCode,
    LineCut,
    LineReader,
    LineTooLong,
    Op,
    encode,
    ok_line,
    request_line,
)

#: Rounds of ``AgentServer.warm_up`` (each: a ping, a stat, an exec of ``WARM_UP_ARGV``).
WARM_UP_ROUNDS = 3
WARM_UP_ARGV = ["/proc/self/exe", "--version"]

Handler = Callable[[dict[str, Any]], "dict[str, Any] | Attachment"]


class Agent:
    """Everything a call may reach: the run folder, identity, the op table. No sockets here."""

    def __init__(self, run_dir: str, helpers_dir: str | None = None, calls: str = "thread") -> None:
        """``helpers_dir``: where the sockets of jobs and sessions go (the agent's socket's
        folder; default ``run_dir``). ``calls``: ``fork`` or ``thread`` (``jobs.CALLS``)."""
        if calls not in CALLS:
            raise ValueError(f"calls must be one of {', '.join(CALLS)}, not {calls!r}")
        self.run_dir = run_dir
        self.helpers_dir = helpers_dir or run_dir
        self.calls = calls
        self.started = time.monotonic()
        self.pid = os.getpid()  # the agent's, also when a worker answers
        self._reaper: Reaper | None = None
        self._reaper_pid = 0
        scripts = os.path.join(run_dir, "sessions")
        self.sessions: Sessions | ThreadSessions
        if calls == "thread":
            self._reaper, self._reaper_pid = Reaper(), os.getpid()  # its thread starts in start()
            self.sessions = ThreadSessions(self._reaper, scripts)
        else:
            self.sessions = Sessions(os.path.join(self.helpers_dir, "sessions"), scripts)
        self.handlers: dict[Op, Handler] = {
            Op.PING: self.ping,
            Op.IDENTIFY: self.identify,
            Op.EXEC: lambda req: execs.exec_op(self.reaper, req),
            Op.SPAWN: lambda req: execs.spawn_op(self.reaper, req),
            Op.KILL: execs.kill_op,
            Op.READ_FILE: files.read_file,
            Op.WRITE_FILE: files.write_file,
            Op.LIST_DIR: files.list_dir,
            Op.STAT: files.stat_op,
            Op.REMOVE: files.remove,
            Op.SESSION_OPEN: self.sessions.open,
            Op.SESSION_RUN: self.sessions.run,
            Op.SESSION_CLOSE: self.sessions.close,
            Op.SESSION_LIST: self.sessions.list,
            Op.ATTACH: lambda req: Attachment(self.reaper, req),
            Op.PROCESSES: self.processes,
        }

    @property
    def reaper(self) -> Reaper:
        """This process's reaper (a worker's or a job's own), its thread started on first use."""
        if self._reaper is None or self._reaper_pid != os.getpid():
            self._reaper = Reaper()
            self._reaper.start_thread()
            self._reaper_pid = os.getpid()
        return self._reaper

    def start(self) -> None:
        """``fork``: let the kernel reap the agent's children and orphans (it runs no thread);
        ``thread``: the reaper thread does (it also waits for the calls' children)."""
        self.pid = os.getpid()
        if self.calls == "fork":
            forks.become_reaper()
        else:
            forks.become_subreaper()
            assert self._reaper is not None
            self._reaper.start_thread()  # now: as pid 1 it reaps orphans from the start

    def stop(self) -> None:
        """Kill every process below the agent: workers, jobs, sessions and what they started."""
        if isinstance(self.sessions, ThreadSessions):
            self.sessions.close_all()
        forks.kill_tree(os.getpid())

    def handle(self, request: dict[str, Any]) -> dict[str, Any] | Attachment:
        return self.handlers[request[OP]](request)  # a str keys its Op: no Enum call

    def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "version": VERSION,
            "uptime_s": time.monotonic() - self.started,
            "identity": self.identity(),
        }

    def processes(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every process but the agent's helpers (workers, jobs, sessions' holders: the
        agent's own plumbing, threads of it before), as the agent alone was listed."""
        procs = procfs.list_processes()
        names = {p["pid"]: p["name"] for p in procs}
        plumbing = {self.pid, *(pid for pid, name in names.items() if name in forks.HELPERS)}
        return {"processes": [p for p in procs
                              if p["name"] not in forks.HELPERS or p["ppid"] not in plumbing]}

    def identity(self) -> dict[str, Any]:
        """Who this workspace is, from ``identity.json`` (the host writes it into a clone
        before restoring it, so a fresh clone needs no call and touches no memory)."""
        try:  # os.read and json.loads: no io objects (each object a call touches is a page a clone copies)
            fd = os.open(os.path.join(self.run_dir, "identity.json"), os.O_RDONLY | os.O_CLOEXEC)
            try:
                raw = os.read(fd, 1 << 20)
            finally:
                os.close(fd)
            data = json.loads(raw.decode())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def identify(self, req: dict[str, Any]) -> dict[str, Any]:
        """Store the identity (after a fork: which clone this is) and publish it in files."""
        identity = arg_any(req, "identity")
        if not isinstance(identity, dict):
            raise invalid('argument "identity" must be an object')
        os.makedirs(self.run_dir, exist_ok=True)
        _write_atomic(os.path.join(self.run_dir, "identity.json"), json.dumps(identity) + "\n")
        fork_id_path = os.path.join(self.run_dir, "fork-id")
        if identity.get("fork_id") is not None:
            _write_atomic(fork_id_path, f"{identity['fork_id']}\n")
        elif os.path.lexists(fork_id_path):
            os.unlink(fork_id_path)
        return {}


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class AgentServer:
    """Accepts connections on a unix socket; each carries sequential requests."""

    def __init__(self, agent: Agent, socket_path: str) -> None:
        self.agent = agent
        self.socket_path = socket_path
        calls = self.calls = agent.calls
        self._sock: socket.socket | None = None
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket's name
        answer: Callable[[dict[str, Any]], bytes] = lambda req: self._reply(encode(req)[:-1])  # noqa: E731
        self.jobs = Jobs(os.path.join(agent.helpers_dir, "jobs"), answer)
        #: ``thread``: the threads that serve connections and run jobs (started by the calls)
        self.pool = Pool() if calls == "thread" else None
        self.thread_jobs = ThreadJobs(answer, self.pool) if self.pool is not None else None

    def bind(self) -> None:
        """Create the listening socket (replacing a stale one), mode 0600."""
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        if os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        address, dir_fd = unix_address(self.socket_path)
        old_umask = os.umask(0o177)
        try:
            sock.bind(address)
        finally:
            os.umask(old_umask)
            if dir_fd is not None:
                os.close(dir_fd)
        sock.listen(128)
        self._sock = sock
        st = os.lstat(self.socket_path)
        self._bound = (st.st_dev, st.st_ino)

    def heal(self) -> bool:
        """Re-create the socket if its name no longer leads to it (``wire.REBIND_SIGNAL``: a process
        inside removed or replaced it, and the host, finding it so, asks). The new socket takes
        the old one's descriptor number (``dup2``), so the accept loop, retried after the
        signal, accepts on it. True if it was re-created. The agent's own process only: a
        worker, job or holder inherits the handler but listens on nothing."""
        old = self._sock
        if old is None or os.getpid() != self.agent.pid:
            return False
        try:
            st = os.lstat(self.socket_path)
            if stat.S_ISSOCK(st.st_mode) and ((st.st_dev, st.st_ino) == self._bound or self._listens_there()):
                self._bound = (st.st_dev, st.st_ino)  # a clone's: CRIU bound it anew at restore
                return False
        except OSError:
            pass
        folder = os.path.dirname(self.socket_path)
        try:
            if os.path.islink(folder) or (os.path.lexists(folder) and not os.path.isdir(folder)):
                os.unlink(folder)  # the workspace put something else where the folder was
            if os.path.isdir(self.socket_path) and not os.path.islink(self.socket_path):
                os.rename(self.socket_path, f"{self.socket_path}.in-the-way.{time.time_ns()}")  # kept, aside
            self.bind()
        except OSError as exc:
            self._sock = old
            _say(f"cannot re-create the socket {self.socket_path}: {exc}")
            return False
        new, self._sock = self._sock, old
        assert new is not None
        os.dup2(new.fileno(), old.fileno())
        new.close()
        _say(f"re-created the socket {self.socket_path} (it was removed or replaced)")
        return True

    def serve_forever(self) -> None:
        """Accept until ``close``, a worker forked per connection; a failing accept or fork
        never ends the agent.

        The loop is kept small on purpose: in a clone, every object it touches has its
        reference count written, and each page it writes is the clone's own. (A worker
        forked ahead of the call instead would keep the pages its fork wrote while it
        waits: ~800 KiB in a clone, measured.)
        """
        if self.calls == "thread":
            self._serve_threads()
            return
        assert self._sock is not None
        accept = self._sock._accept  # type: ignore[attr-defined]  # noqa: SLF001 - (fd, address): no socket object
        fork, close = os.fork, os.close
        while self._sock is not None:
            try:
                fd, _ = accept()
            except OSError as exc:  # e.g. EMFILE: wait for descriptors to be freed
                if self._sock is None:
                    return
                print(f"bunshin-agent: accept failed: {exc}", file=sys.stderr)
                time.sleep(0.05)
                continue
            try:
                pid = fork()
            except OSError as exc:  # no process left (pids limit): refuse this one
                self._refuse(fd, exc)
                continue
            if pid == 0:
                self._worker(fd)
            close(fd)

    def _serve_threads(self) -> None:
        """``--calls thread``: each connection served on a thread of the pool; a failing
        accept or thread start never ends the agent."""
        assert self.pool is not None and self._sock is not None
        # The descriptor only: its socket object is made on the pool's thread, in that
        # thread's malloc arena (the main thread's holes are all over the snapshot's heap).
        accept, submit, serve = self._sock._accept, self.pool.submit, self._serve_fd  # type: ignore[attr-defined]  # noqa: SLF001
        while self._sock is not None:
            try:
                fd, _ = accept()
            except OSError as exc:
                if self._sock is None:
                    return
                print(f"bunshin-agent: accept failed: {exc}", file=sys.stderr)
                time.sleep(0.05)
                continue
            try:
                submit(serve, fd)
            except RuntimeError as exc:  # no thread left (pids limit): refuse this one
                self._refuse(fd, exc)

    def _listens_there(self) -> bool:
        """Whether the socket at the path is this process's (``SO_PEERCRED``), as after a
        restore, which binds it anew: a connection it never serves (closed at once)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
            probe.setblocking(False)  # a full backlog must not block the signal handler
            address, dir_fd = unix_address(self.socket_path)
            try:
                probe.connect(address)
                pid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            except OSError:
                return False
            finally:
                if dir_fd is not None:
                    os.close(dir_fd)
        return pid == os.getpid()

    def warm_up(self, rounds: int = WARM_UP_ROUNDS) -> None:
        """Answer a few pings, stats (of the socket's folder: a walk of a few components) and
        execs (as jobs) before the agent is ready.

        Python 3.12 rewrites a function's bytecode the first times it runs (specialising it)
        and counts down in it after: in a forked clone each function a call runs for the first
        or second time writes (and so copies) the page it sits on. Run here, the call paths
        are specialised once in the snapshot. What runs is the agent's own executable
        (``/proc/self/exe --version``: the agent layer's loader, or its Python), never a
        program of the image.
        """
        reply = self._answer
        for _ in range(rounds):
            reply(request_line(Op.PING, {}).rstrip(b"\n"))
            reply(request_line(Op.STAT, {"path": os.path.dirname(self.socket_path)}).rstrip(b"\n"))  # a walk (pathwalk)
            started = reply(request_line(Op.JOB_START, {JOB_REQUEST: {OP: Op.EXEC.value, "argv": WARM_UP_ARGV}}).rstrip(b"\n"))
            if not isinstance(started, bytes):
                return
            job_id = json.loads(started).get(JOB_ID)
            if not isinstance(job_id, str):
                return  # could not start one (pids limit): the agent works, only less warm
            reply(request_line(Op.JOB_WAIT, {JOB_ID: job_id, JOB_WAIT: 10.0}).rstrip(b"\n"))

    def trim(self) -> dict[str, int]:
        """End the pool's waiting threads (before a fork: CRIU dumps every thread inside the
        pause). ``threads``: the agent's threads once they, and the thread answering this
        (a pool's), have ended; busy ones end with their call. ``fork`` has no pool (a
        worker answers: the agent's own count)."""
        try:
            threads = len(os.listdir(f"/proc/{self.agent.pid}/task"))
        except OSError:
            threads = 1  # no /proc to count in: the host finds nothing to wait for either
        if self.pool is None:
            return {"threads": threads}
        ending = self.pool.threads - self.pool.trim()  # the idle ones
        return {"threads": max(1, threads - ending - 1)}

    def _serve_fd(self, fd: int) -> None:
        self._serve(socket.socket(fileno=fd))

    def _refuse(self, fd: int, exc: Exception) -> None:
        with socket.socket(fileno=fd) as conn:
            _send(conn, failure(cannot_start("a thread or worker for the connection", exc)))

    def _worker(self, fd: int) -> None:
        """The forked worker: serve connection ``fd``, then end (never returns)."""
        forks.as_helper(forks.WORKER)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.jobs.adopt = True
        forks.run_and_exit(lambda: self._work(fd))

    def _work(self, fd: int) -> None:
        self._serve(socket.socket(fileno=fd))
        if self.jobs.adopted is not None:  # this worker runs a job: serve its job_wait now
            forks.as_helper(forks.JOB)
            self.jobs.adopted.serve()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            reader = LineReader(conn.recv)
            while True:
                try:
                    line = reader.readline()
                except LineTooLong:  # cannot find the next request: give up
                    _send(conn, failure(invalid(f"request line longer than {reader.limit} bytes")))
                    return
                except LineCut:
                    _send(conn, failure(invalid("connection closed in the middle of a request")))
                    return
                except OSError:
                    return
                if line is None:
                    return
                if not line.strip():
                    continue
                reply = self._answer(line)
                if isinstance(reply, Attachment):
                    if _send(conn, ok_line()):
                        reply.bridge(conn, bytes(reader.buffer))
                    else:
                        reply.close()
                    return
                if not _send(conn, reply):
                    return

    def _reply(self, line: bytes) -> bytes:
        reply = self._answer(line)
        if isinstance(reply, Attachment):  # not reachable: attach is not resumable
            reply.close()
            return failure(AgentFailure(ErrorCode.AGENT_ERROR, "attach cannot run as a job"))
        return reply

    def _answer(self, line: bytes) -> bytes | Attachment:
        op = "?"
        try:
            request = parse_request(line)
            op = request[OP]
            jobs = self.thread_jobs or self.jobs
            if op == Op.JOB_START:
                return jobs.start(request)
            if op == Op.JOB_WAIT:
                return jobs.wait(request)
            if op == Op.TRIM:
                return checked(op, self.trim())
            result = self.agent.handle(request)
        except AgentFailure as exc:
            return failure(exc)
        except Exception as exc:  # never die on a request
            traceback.print_exc(file=sys.stderr)
            return failure(AgentFailure(ErrorCode.AGENT_ERROR, f"internal error in {op}: {exc!r}"))
        if isinstance(result, Attachment):
            return result
        return checked(op, result)


def _say(line: str) -> None:
    """A line in the agent's log from a signal handler (no ``print``: the stream's lock may be held)."""
    try:
        os.write(2, f"bunshin-agent: {line}\n".encode(errors="replace"))
    except OSError:
        pass


def _send(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False
