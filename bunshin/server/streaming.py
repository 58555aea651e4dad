"""``POST /v1/workspaces/{id}/exec/stream``: a command's stdout and stderr as they come.

The agent answers a command once it ends, so the server runs it in the background with
its streams going to files in the workspace's own /tmp and follows them (every
``POLL_S``), answering NDJSON lines: ``{"stream": "stdout"|"stderr", "data": ...}`` as
output arrives, then one ``{"exit_code", "timed_out", "duration_s"}``. Past ``timeout``
the command's process group is killed (exit code -9), and so it is when the caller
disconnects mid-stream (Starlette cancels the answer; the cleanup is shielded). The
files are the workspace's: whatever it does to them changes only what it is told of
its own command. The workspace's lock is held for the whole stream.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import time
import uuid
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from ..api import models as m
from ..errors import BunshinError, PathNotFound
from ..workspace import Workspace
from .context import ServerContext

POLL_S = 0.05
DIR = "/tmp/.bunshin-stream"
CHUNK = 1 << 20
#: Pieces of a stream read in one poll: what the host holds before it sends them on.
DRAIN_CHUNKS = 4


class Follow:
    """One command run in the background and followed through its output files."""

    def __init__(self, ws: Workspace, req: m.ExecRequest) -> None:
        self.ws, self.req = ws, req
        base = f"{DIR}/{uuid.uuid4().hex}"
        self.out, self.err, self.rc = f"{base}.out", f"{base}.err", f"{base}.rc"
        self.offsets = {self.out: 0, self.err: 0}
        self.pid: int | None = None
        self.finished = False
        self.t0 = time.monotonic()

    def start(self) -> None:
        req = self.req
        cmd = req.command if isinstance(req.command, str) else shlex.join(req.command)
        script = (f"mkdir -p {DIR} && : > {self.out} && : > {self.err} && "
                  f"{{ ( {cmd} ) > {self.out} 2> {self.err} < /dev/null; echo $? > {self.rc}; }}")
        self.t0 = time.monotonic()
        self.pid = self.ws.commands.spawn(["/bin/sh", "-c", script], cwd=req.cwd, env=req.env)

    def poll(self) -> tuple[list[bytes], bool]:
        """New output lines, and whether the command ended (then the last line is its status)."""
        lines, drained = self._drain()
        try:
            status = self.ws.files.read(self.rc, length=64).decode(errors="replace").strip()
        except PathNotFound:
            status = ""
        if status:  # it ended: what it wrote after the drain above is there now too
            more, drained = self._drain()
            lines += more
            if not drained:  # output still unread: the next polls send it
                return lines, False
        timed_out = not status and self.req.timeout is not None and time.monotonic() - self.t0 > self.req.timeout
        if not status and not timed_out:
            return lines, False
        if timed_out:
            self._kill()
            lines += self._drain()[0]  # what is left past this is dropped: the command is over its time
        self.finished = True
        code = -9 if timed_out else int(status) if status.lstrip("-").isdigit() else -1
        lines.append(_line({"exit_code": code, "timed_out": timed_out,
                            "duration_s": round(time.monotonic() - self.t0, 4)}))
        return lines, True

    def stop(self) -> None:
        """Kill the command unless it ended, and remove its files."""
        if not self.finished:
            self._kill()
        with contextlib.suppress(BunshinError):
            self.ws.exec(["rm", "-f", self.out, self.err, self.rc], timeout=30)

    def _kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(BunshinError):  # it may have ended meanwhile
                self.ws.commands.kill(self.pid, signal.SIGKILL, group=True)

    def _drain(self) -> tuple[list[bytes], bool]:
        """New output, at most ``DRAIN_CHUNKS`` pieces a stream (the host holds no more between
        two sends), and whether all there was is read."""
        lines, drained = [], True
        for path, stream in ((self.out, "stdout"), (self.err, "stderr")):
            for _ in range(DRAIN_CHUNKS):
                try:
                    data = self.ws.files.read(path, offset=self.offsets[path], length=CHUNK)
                except PathNotFound:
                    break
                self.offsets[path] += len(data)
                if data:
                    lines.append(_line({"stream": stream, "data": data.decode("utf-8", errors="replace")}))
                if len(data) < CHUNK:
                    break
            else:
                drained = False
        return lines, drained


def _line(obj: dict[str, object]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.post("/workspaces/{ws_id}/exec/stream")
    def stream(ws_id: str, req: m.ExecRequest) -> StreamingResponse:
        ws = ctx.ws_of(ws_id)  # a missing workspace is a 404 before the stream starts
        lock = ctx.locks.lock_of(ws)

        async def body() -> AsyncIterator[bytes]:
            while not lock.acquire(blocking=False):  # cancel-safe: no thread waits for it
                await anyio.sleep(0.01)
            follow = Follow(ws, req)
            try:
                await anyio.to_thread.run_sync(follow.start)
                while True:
                    lines, done = await anyio.to_thread.run_sync(follow.poll)
                    for line in lines:
                        yield line
                    if done:
                        return
                    await anyio.sleep(POLL_S)
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(follow.stop)
                lock.release()

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return api
