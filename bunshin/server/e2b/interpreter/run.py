"""One ``run_code``: the request to the context's interpreter, its output read while it
grows, and the answer as E2B's JSON lines.

The call is one exec (``contexts.run_argv``) in a thread of its own, holding the
workspace's lock from before it starts until the last read of its output is done (so a fork
never meets it in flight). While it runs, the interpreter writes the run's stdout and
stderr to two files of the context's folder; they are read from where the last read ended
every :data:`POLL_S` and sent as ``stdout`` / ``stderr`` lines. The answer's own copy of
both gives whatever the last read missed. A caller that hangs up interrupts the code
(SIGINT: ``KeyboardInterrupt``, as Jupyter's interrupt does).
"""

from __future__ import annotations

import codecs
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from ....errors import BunshinError, PathNotFound
from ....workspace.protocol import WorkspaceAPI
from . import contexts

#: Longest a run may take (the SDK's own default is 300 s; a caller that hangs up ends it sooner).
MAX_RUN_S = 3600.0
POLL_S = 0.1
_READ = 1 << 20
#: A result's displays by MIME type, as E2B's ``Result`` fields.
_FIELDS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
           "image/png": "png", "image/jpeg": "jpeg", "text/latex": "latex", "application/json": "json"}


def line(kind: str, **fields: Any) -> bytes:
    return json.dumps({"type": kind, **fields}).encode() + b"\n"


class _Stream:
    """One output stream read as it grows: whole lines out, the unfinished one kept."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind, self.path = kind, path
        self.offset = 0  # bytes read
        self.text = ""  # what was decoded of them
        self.pending = ""  # the unfinished last line
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, data: bytes, final: bool = False) -> list[bytes]:
        self.offset += len(data)
        piece = self.decoder.decode(data, final)
        self.text += piece
        return self._lines(piece, final)

    def _lines(self, piece: str, final: bool) -> list[bytes]:
        *whole, self.pending = (self.pending + piece).split("\n")
        now = time.time_ns()
        out = [line(self.kind, text=p + "\n", timestamp=now) for p in whole]
        if final and self.pending:
            out.append(line(self.kind, text=self.pending, timestamp=now))
            self.pending = ""
        return out

    def finish(self, whole: str) -> list[bytes]:
        """The rest, from the answer's copy of the whole stream."""
        self.text += self.decoder.decode(b"", True)
        rest = whole[len(self.text):] if whole.startswith(self.text) else ""
        return self._lines(rest, True)


class CodeRun:
    """A run in flight (see the module's docstring); ``stop`` before dropping it."""

    def __init__(self, ws: WorkspaceAPI, context_id: str, code: str, env: dict[str, str],
                 lock: threading.Lock) -> None:
        self.ws, self.context_id, self.lock = ws, context_id, lock
        exec_id = uuid.uuid4().hex
        self.request = json.dumps({"code": code, "timeout": MAX_RUN_S, "split": True, "env": env,
                                   "exec_id": exec_id})
        base = f"{contexts.folder(context_id)}/{exec_id}"
        self.streams = (_Stream("stdout", base + ".out"), _Stream("stderr", base + ".err"))
        self.done = threading.Event()
        self.result: Any = None
        self._guard = threading.Lock()
        self._sides = 2  # the call and the reader: the last one to end gives the lock back
        self._started = False
        self._thread = threading.Thread(target=self._call, name=f"e2b-run-{context_id}", daemon=True)

    def start(self) -> None:
        """Take the workspace's lock (blocking) and start the call."""
        self.lock.acquire()
        self._started = True
        self._thread.start()

    def _call(self) -> None:
        try:
            self.result = self.ws.exec(contexts.run_argv(self.context_id), stdin=self.request,
                                       timeout=MAX_RUN_S + 30)
        except BaseException as e:  # handed to the streaming side
            self.result = e
        finally:
            self.done.set()
            self._side_done()

    def stop(self) -> None:
        """The reader is done: the lock goes back once the call has ended too."""
        if self._started:
            self._side_done()

    def _side_done(self) -> None:
        with self._guard:
            self._sides -= 1
            last = self._sides == 0
        if last:
            self.lock.release()

    def poll(self) -> list[bytes]:
        """New output since the last poll (nothing yet if the run has not made its files)."""
        out: list[bytes] = []
        for s in self.streams:
            try:
                data = self.ws.files.read(s.path, offset=s.offset, length=_READ)
            except PathNotFound:
                continue
            except BunshinError:
                continue  # the workspace is busy dying: the answer (or its error) says so
            out += s.feed(data)
        return out

    def interrupt(self) -> None:
        try:
            contexts.interrupt(self.ws, self.context_id)
        except BunshinError:
            pass  # gone with its workspace

    def answer(self) -> Iterator[bytes]:
        """The lines after the call ended: the output's rest, result, error, count, end."""
        reply, failure = self._reply()
        yield from self.streams[0].finish(str(reply.get("stdout", "")))
        yield from self.streams[1].finish(str(reply.get("stderr", "")))
        shown = reply.get("result")
        if isinstance(shown, dict):
            fields = {_FIELDS[k]: v for k, v in shown.items() if k in _FIELDS}
            if "json" in fields and not isinstance(fields["json"], dict):
                fields.pop("json")
            yield line("result", is_main_result=True, **fields)
        error = reply.get("error") or failure
        if isinstance(error, dict):
            yield line("error", name=str(error.get("name")), value=str(error.get("value")),
                       traceback=str(error.get("traceback", "")))
        if isinstance(reply.get("count"), int):
            yield line("number_of_executions", execution_count=reply["count"])
        yield line("end_of_execution")

    def _reply(self) -> tuple[dict[str, Any], dict[str, str] | None]:
        r = self.result
        if isinstance(r, BaseException):
            return {}, _failure(type(r).__name__, str(r))
        if r.exit_code == contexts.MISSING:
            return {}, _failure("ContextNotFound", f"context {self.context_id!r} was removed")
        if r.exit_code == 127:
            return {}, _failure("InterpreterUnavailable", "python3 is not installed in this sandbox's image "
                                "(the code interpreter runs the image's own python3)")
        try:
            reply = json.loads(r.stdout)
            if not isinstance(reply, dict):
                raise ValueError(reply)
        except ValueError:
            return {}, _failure("InterpreterFailed", f"the interpreter call failed ({r.exit_code}): "
                                f"{(r.stderr or r.stdout).strip()[-2000:]}")
        if "stdout" not in reply:  # the interpreter ignored the interrupt and was killed
            return {}, _failure("KeyboardInterrupt", str(reply.get("output", "")).strip())
        return reply, None


def _failure(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value, "traceback": f"{name}: {value}\n"}
