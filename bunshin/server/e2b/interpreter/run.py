"""One ``run_code``: the request to the context's interpreter, its output read while it
grows, and the answer as E2B's JSON lines.

The call runs in the background inside the workspace (``contexts.run_argv``): the request is
written to a file, the call started, and from then on only short agent calls are made, each
holding the workspace's lock on its own (as envd's do), so other calls into the sandbox,
and a fork, go on while code runs. A fork taken meanwhile has the run in its own copy, which
ends there unread. While it runs, the interpreter writes the run's stdout and stderr to two
files of the context's folder; they are read from where the last read ended, at first every
few milliseconds and then every :data:`POLL_S`, and sent as ``stdout`` / ``stderr`` lines
until the answer appears; its own copy of both gives whatever the reads missed. A caller
that hangs up interrupts the code (SIGINT: ``KeyboardInterrupt``, as Jupyter's interrupt does).
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
#: Polls of a run's output and answer: the first after this, each wait twice the last, up to POLL_S.
FIRST_POLL_S = 0.005
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
    """A run in flight (see the module's docstring); every method blocks (call it in a thread)."""

    def __init__(self, ws: WorkspaceAPI, context_id: str, code: str, env: dict[str, str],
                 lock: threading.Lock) -> None:
        self.ws, self.context_id, self.lock = ws, context_id, lock
        run_id = uuid.uuid4().hex
        self.request = json.dumps({"code": code, "timeout": MAX_RUN_S, "split": True, "env": env,
                                   "exec_id": run_id})
        self.run_base = f"{contexts.RUNS_DIR}/{run_id}"
        base = f"{contexts.folder(context_id)}/{run_id}"
        self.streams = (_Stream("stdout", base + ".out"), _Stream("stderr", base + ".err"))
        self.reply: dict[str, Any] | None = None  # the call's answer, once it ended

    @property
    def done(self) -> bool:
        return self.reply is not None

    def start(self) -> None:
        with self.lock:
            self.ws.files.write(self.run_base + ".req", self.request)
            self.ws.commands.spawn(contexts.run_argv(self.context_id, self.run_base))

    def poll(self) -> list[bytes]:
        """New output since the last poll (nothing yet if the run has not made its files);
        the answer, once it is there, in :attr:`reply`."""
        out: list[bytes] = []
        with self.lock:
            try:
                raw = self.ws.files.read(self.run_base + ".reply")
            except PathNotFound:
                raw = None
            for s in self.streams:
                try:
                    out += s.feed(self.ws.files.read(s.path, offset=s.offset, length=_READ))
                except PathNotFound:
                    continue
            if raw is not None:
                self.reply = self._parse(raw)
                self.ws.exec(["rm", "-f", self.run_base + ".reply", self.run_base + ".log"], timeout=30)
        return out

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            reply = json.loads(raw)
            if not isinstance(reply, dict):
                raise ValueError(reply)
        except ValueError:
            return {"failure": _failure("InterpreterFailed", f"the interpreter answered {raw[:200]!r}")}
        if "exit_status" in reply:
            reply["log"] = self._log()
        return reply

    def _log(self) -> str:
        try:
            return self.ws.files.read(self.run_base + ".log", length=4096).decode("utf-8", "replace")
        except PathNotFound:
            return ""

    def interrupt(self) -> None:
        try:
            with self.lock:
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
        reply = self.reply or {}
        if "failure" in reply:
            return {}, reply["failure"]
        status = reply.get("exit_status")
        if status == contexts.MISSING:
            return {}, _failure("ContextNotFound", f"context {self.context_id!r} was removed")
        if status == 127:
            return {}, _failure("InterpreterUnavailable", "python3 is not installed in this sandbox's image "
                                "(the code interpreter runs the image's own python3)")
        if status is not None:
            return {}, _failure("InterpreterFailed", f"the interpreter call failed ({status}): "
                                f"{str(reply.get('log', '')).strip()[-2000:]}")
        if "stdout" not in reply:  # the interpreter ignored the interrupt and was killed
            return {}, _failure("KeyboardInterrupt", str(reply.get("output", "")).strip())
        return reply, None


def _failure(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value, "traceback": f"{name}: {value}\n"}
