"""The agent's state, its op table, and the unix socket server (a thread per connection)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import execs, files, procfs
from .children import Reaper
from .jobs import Jobs
from .protocol import AgentFailure, arg_any, failure, invalid, parse_request, unix_address
from .sessions import Sessions
from .terminals import Attachment
from .wire import (
    OP,
    SPEC,
    VERSION,
    ErrorCode,
    LineCut,
    LineReader,
    LineTooLong,
    Op,
    encode,
    ok_line,
)

Handler = Callable[[dict[str, Any]], "dict[str, Any] | Attachment"]


class Agent:
    """Everything the agent holds: children, sessions, identity. No sockets here."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.started = time.monotonic()
        self.reaper = Reaper()
        self.sessions = Sessions(self.reaper, os.path.join(run_dir, "sessions"))
        reaper = self.reaper
        self.handlers: dict[Op, Handler] = {
            Op.PING: self.ping,
            Op.IDENTIFY: self.identify,
            Op.EXEC: lambda req: execs.exec_op(reaper, req),
            Op.SPAWN: lambda req: execs.spawn_op(reaper, req),
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
            Op.ATTACH: lambda req: Attachment(reaper, req),
            Op.PROCESSES: lambda req: {"processes": procfs.list_processes()},
        }

    def start(self) -> None:
        self.reaper.start_thread()

    def stop(self) -> None:
        """Close sessions and kill every child (the agent is going away)."""
        self.sessions.close_all()
        self.reaper.kill_all()

    def handle(self, request: dict[str, Any]) -> dict[str, Any] | Attachment:
        return self.handlers[Op(request[OP])](request)

    def ping(self, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "version": VERSION,
            "uptime_s": time.monotonic() - self.started,
            "identity": self.identity(),
        }

    def identity(self) -> dict[str, Any]:
        """Who this workspace is, from ``identity.json`` (the host writes it into a clone
        before restoring it, so a fresh clone needs no call and touches no memory)."""
        try:
            with open(os.path.join(self.run_dir, "identity.json"), encoding="utf-8") as f:
                data = json.load(f)
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
        self._sock: socket.socket | None = None
        self.jobs = Jobs(lambda req: self._reply(encode(req)[:-1]))

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

    def serve_forever(self) -> None:
        """Accept until ``close``; a failing accept or thread start never ends the agent."""
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:  # e.g. EMFILE: wait for descriptors to be freed
                if self._sock is None:
                    return
                print(f"bunshin-agent: accept failed: {exc}", file=sys.stderr)
                time.sleep(0.05)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="conn", daemon=True).start()
            except RuntimeError as exc:  # no thread left (pids limit): refuse this one
                _send(conn, failure(AgentFailure(ErrorCode.RESOURCE_EXHAUSTED, f"agent: {exc}")))
                conn.close()

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
            if op == Op.JOB_START:
                return self.jobs.start(request)
            if op == Op.JOB_WAIT:
                return self.jobs.wait(request)
            result = self.agent.handle(request)
        except AgentFailure as exc:
            return failure(exc)
        except Exception as exc:  # never die on a request
            traceback.print_exc(file=sys.stderr)
            return failure(AgentFailure(ErrorCode.AGENT_ERROR, f"internal error in {op}: {exc!r}"))
        if isinstance(result, Attachment):
            return result
        undeclared = result.keys() - SPEC[Op(op)].answer
        if undeclared:
            return failure(AgentFailure(
                ErrorCode.AGENT_ERROR, f"the answer to {op} has fields wire.SPEC does not declare: "
                f"{', '.join(sorted(undeclared))}"))
        try:
            return ok_line(result)
        except (TypeError, ValueError) as exc:
            return failure(AgentFailure(ErrorCode.AGENT_ERROR, f"cannot encode the answer to {op}: {exc}"))


def _send(conn: socket.socket, data: bytes) -> bool:
    try:
        conn.sendall(data)
        return True
    except OSError:
        return False
