"""envd's ``process.Process`` service: Start, Connect, List, SendSignal, SendInput.

``Start`` answers a start event (the command's pid), its output as data events as it
comes, keepalives every ``Keepalive-Ping-Interval`` seconds the SDK asks for, and an end
event with the exit status; past the call's deadline (``connect-timeout-ms``: the SDK's
``timeout``) the command's process group is killed and the call ends
``deadline_exceeded`` (a client hanging up at its deadline is taken for it). A client that
hangs up otherwise stops being followed; the command goes on (as E2B's:
``commands.connect(pid)`` finds it again) and nothing on the host is left behind. A PTY command (``Start`` with ``pty``) runs on a terminal of its own
(``ptyrelay``), its screen as ``pty`` data events; ``Update`` resizes it; ``SendInput``
and ``StreamInput`` type into it or write a command's stdin; ``CloseStdin`` ends that
stdin. Processes are selected by pid or by the tag they were started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import anyio
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext

from ....errors import BunshinError, PathNotFound
from ..sandbox_logs import Level, logs_of
from . import procs
from .gen.process import process_pb2 as pb
from .rpc import FOLLOWING, Call, service_app

#: Seconds between two looks at a command's files: a tenth of how long it has been quiet,
#: within these bounds (a quick command is seen ending within a few ms, an idle one costs
#: about ten agent calls a second).
POLL_MIN_S, POLL_MAX_S, POLL_QUIET_SHARE = 0.002, 0.1, 0.1
#: Keepalive interval when the client names none, and bounds on the one it names.
KEEPALIVE_S, KEEPALIVE_MIN_S = 30.0, 1.0
#: Most arguments, environment variables and bytes of them a command takes.
MAX_ARGS, MAX_ENVS, MAX_SPEC_BYTES = 4096, 1024, 1 << 20
log = logging.getLogger("bunshin.server")
MAX_TERM = 1000
MAX_TAG = 256
#: A Start client hanging up this close to its deadline is taken for its timeout.
DEADLINE_SLACK_S = 1.0
_BACKGROUND: set[asyncio.Task[Any]] = set()  # held until done (the loop keeps weak references)


def _later(job: Coroutine[Any, Any, Any]) -> None:
    """Run ``job`` on its own; its failure is only logged."""
    async def run() -> None:
        try:
            await job
        except Exception as e:
            log.info("envd: a run's files were not removed: %s", e)

    task = asyncio.get_running_loop().create_task(run())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_SIGNALS = {pb.SIGNAL_SIGKILL: signal.SIGKILL, pb.SIGNAL_SIGTERM: signal.SIGTERM}


def _spec(req: Any) -> procs.Spec:
    p = req.process
    pty = None
    if req.HasField("pty"):
        pty = (req.pty.size.rows or 24, req.pty.size.cols or 80)
        _check_size(*pty)
    if not p.cmd or "\0" in p.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd must be a non-empty string without NUL")
    args, envs = tuple(p.args), dict(p.envs)
    size = len(p.cmd) + sum(map(len, args)) + sum(len(k) + len(v) for k, v in envs.items())
    if len(args) > MAX_ARGS or len(envs) > MAX_ENVS or size > MAX_SPEC_BYTES:
        raise ConnectError(Code.INVALID_ARGUMENT, f"the command is over {MAX_ARGS} args, {MAX_ENVS} envs "
                                                  f"or {MAX_SPEC_BYTES} bytes")
    if any("\0" in a for a in args) or any(not k or "=" in k or "\0" in k + v for k, v in envs.items()):
        raise ConnectError(Code.INVALID_ARGUMENT, "an argument or environment variable has a NUL byte or a bad name")
    cwd = p.cwd if p.HasField("cwd") and p.cwd else None
    if cwd is not None and (not cwd.startswith("/") or "\0" in cwd):
        raise ConnectError(Code.INVALID_ARGUMENT, f"cwd {cwd[:100]!r} must be an absolute path")
    tag = req.tag if req.HasField("tag") else None
    if tag is not None and len(tag) > MAX_TAG:
        raise ConnectError(Code.INVALID_ARGUMENT, f"a tag is at most {MAX_TAG} characters")
    stdin = req.stdin if req.HasField("stdin") else True
    return procs.Spec(p.cmd, args, envs, cwd, tag, stdin, pty)


def _check_size(rows: int, cols: int) -> None:
    if not (1 <= rows <= MAX_TERM and 1 <= cols <= MAX_TERM):
        raise ConnectError(Code.INVALID_ARGUMENT, f"a terminal is 1..{MAX_TERM} rows and columns")


def _keepalive_s(ctx: RequestContext) -> float:
    text = ctx.request_headers.get("keepalive-ping-interval", "")
    try:
        return max(KEEPALIVE_MIN_S, float(text))
    except ValueError:
        return KEEPALIVE_S


async def _pid_of(call: Call, selector: Any) -> int:
    """The pid a selector names: its pid, or the running command started with its tag."""
    if selector.WhichOneof("selector") == "tag":
        tag = selector.tag
        found = [pid for pid, meta in await procs.run(call, procs.listing, call) if meta.get("tag") == tag]
        if not found:
            raise ConnectError(Code.NOT_FOUND, f"no running process has tag {tag[:100]!r}")
        return min(found)
    return int(selector.pid)


def _delay(quiet_s: float) -> float:
    return min(POLL_MAX_S, max(POLL_MIN_S, quiet_s * POLL_QUIET_SHARE))


async def _wait_pid(call: Call, folder: str, deadline: float | None) -> int:
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(PathNotFound):
            text = (await procs.poll(call, call.ws.files.read, f"{folder}/pid", length=32)).decode().strip()
            if text.isdigit():
                return int(text)
        if deadline is not None and time.monotonic() > deadline:
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the command did not start before the deadline")
        await anyio.sleep(_delay(time.monotonic() - t0))


async def follow(call: Call, folder: str, pid: int, ctx: RequestContext, event: type,
                 *, offsets: dict[str, int], owned: bool, pty: bool) -> AsyncIterator[Any]:
    """The data, keepalive and end events of the command in ``folder`` from ``offsets`` on;
    ``owned``: the call started it (its deadline kills it, and its files go when it is
    reported ended). The caller holds ``FOLLOWING`` for the sandbox."""
    async for e in _follow(call, folder, pid, ctx, event, offsets, owned, pty):
        yield e


async def _follow(call: Call, folder: str, pid: int, ctx: RequestContext, event: type,
                  offsets: dict[str, int], owned: bool, pty: bool) -> AsyncIterator[Any]:
    ms = ctx.timeout_ms
    deadline = None if ms is None else time.monotonic() + ms / 1000
    keepalive, last = _keepalive_s(ctx), time.monotonic()
    heard = last  # when output last came
    while not call.gone.is_set():  # a client that hung up is followed no more (the command goes on)
        sizes = {f.name: f.size for f in await procs.poll(call, procs.entries, call, folder)}
        if not sizes:
            raise ConnectError(Code.NOT_FOUND, f"process with pid {pid} not found")
        for name, field in (("out", "pty" if pty else "stdout"), ("err", "stderr")):
            while sizes.get(name, 0) > offsets[name]:
                data = await procs.poll(call, call.ws.files.read, f"{folder}/{name}", offset=offsets[name],
                                        length=procs.CHUNK)
                if not data:
                    break
                offsets[name] += len(data)
                yield event(event=pb.ProcessEvent(data=pb.ProcessEvent.DataEvent(**{field: data})))
                last = heard = time.monotonic()
        status = procs.status_of(sizes)
        if status is not None:
            end = _end(status)
            yield event(event=pb.ProcessEvent(end=end))
            if owned:  # after the answer: nobody waits for it
                _log(call, Level.INFO if status == 0 else Level.WARN, f"process {pid} ended: {end.status}",
                     event="process.end", pid=pid, status=end.status)
                _later(procs.poll(call, procs.remove, call, folder, pid))
            return
        now = time.monotonic()
        if deadline is not None and now > deadline:
            if owned:
                _log(call, Level.WARN, f"process {pid} killed: it ran past its timeout", event="process.timeout",
                     pid=pid)
                with contextlib.suppress(BunshinError):
                    await procs.poll(call, call.ws.commands.kill, pid, signal.SIGKILL, group=True)
                    await procs.poll(call, procs.remove, call, folder, pid)
            raise ConnectError(Code.DEADLINE_EXCEEDED, "the command ran past its timeout and was killed"
                               if owned else "the connection ran past its timeout")
        if now - last >= keepalive:
            last = now
            yield event(event=pb.ProcessEvent(keepalive=pb.ProcessEvent.KeepAlive()))
        await anyio.sleep(_delay(time.monotonic() - heard))
    if owned and deadline is not None and time.monotonic() > deadline - DEADLINE_SLACK_S:
        # the client hung up at its timeout (it keeps the same deadline): the command goes as it would here
        with contextlib.suppress(BunshinError):
            await procs.poll(call, call.ws.commands.kill, pid, signal.SIGKILL, group=True)
            await procs.poll(call, procs.remove, call, folder, pid)


def _log(call: Call, level: Level, message: str, **fields: object) -> None:
    """An entry in the sandbox's logs (E2B's ``/sandboxes/{id}/logs``)."""
    logs_of(call.ctx).record(call.ws.id, level, message, **fields)


def _end(code: int) -> Any:
    if code > 128:  # sh's status of a command a signal ended
        sig = code - 128
        with contextlib.suppress(ValueError):
            name = signal.Signals(sig).name.removeprefix("SIG").lower()
            return pb.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    return pb.ProcessEvent.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")


async def start(req: Any, call: Call, ctx: RequestContext) -> AsyncIterator[Any]:
    spec = _spec(req)
    ms = ctx.timeout_ms
    deadline = None if ms is None else time.monotonic() + ms / 1000
    with FOLLOWING.held(call.ws.id):  # refused before the command starts
        folder = await procs.run(call, procs.start, call, spec)
        pid = await _wait_pid(call, folder, deadline)
        _log(call, Level.INFO, f"process {pid} started: {' '.join([spec.cmd, *spec.args])}", event="process.start",
             pid=pid, cmd=spec.cmd, tag=spec.tag or "", pty=spec.pty is not None)
        yield pb.StartResponse(event=pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=pid)))
        async for e in follow(call, folder, pid, ctx, pb.StartResponse, offsets={"out": 0, "err": 0}, owned=True,
                              pty=spec.pty is not None):
            yield e


async def connect(req: Any, call: Call, ctx: RequestContext) -> AsyncIterator[Any]:
    with FOLLOWING.held(call.ws.id):
        pid = await _pid_of(call, req.process)
        folder = await procs.run(call, procs.folder_of, call, pid)
        pty = bool((await procs.run(call, procs.meta_of, call, folder)).get("pty"))
        # what comes from now on: the sizes before the start event, which the client waits for
        offsets = {f.name: f.size for f in await procs.run(call, procs.entries, call, folder)
                   if f.name in ("out", "err")}
        yield pb.ConnectResponse(event=pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=pid)))
        async for e in follow(call, folder, pid, ctx, pb.ConnectResponse, offsets={"out": 0, "err": 0, **offsets},
                              owned=False, pty=pty):
            yield e


async def list_(req: Any, call: Call, ctx: RequestContext) -> Any:
    found = await procs.run(call, procs.listing, call)
    out = pb.ListResponse()
    for pid, meta in found:
        info = out.processes.add(pid=pid)
        info.config.cmd = str(meta.get("cmd", ""))
        info.config.args.extend(str(a) for a in meta.get("args") or [])
        info.config.envs.update({str(k): str(v) for k, v in (meta.get("envs") or {}).items()})
        if meta.get("cwd"):
            info.config.cwd = str(meta["cwd"])
        if meta.get("tag"):
            info.tag = str(meta["tag"])
    return out


async def send_signal(req: Any, call: Call, ctx: RequestContext) -> Any:
    pid = await _pid_of(call, req.process)
    sig = _SIGNALS.get(req.signal)
    if sig is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
    await procs.run(call, procs.folder_of, call, pid)  # only the commands envd started
    await procs.run(call, call.ws.commands.kill, pid, sig, group=True)
    _log(call, Level.INFO, f"process {pid} sent {sig.name}", event="process.signal", pid=pid, signal=sig.name)
    return pb.SendSignalResponse()


def _input(msg: Any) -> bytes:
    kind = msg.WhichOneof("input")
    return bytes(msg.stdin if kind == "stdin" else msg.pty if kind == "pty" else b"")


async def send_input(req: Any, call: Call, ctx: RequestContext) -> Any:
    folder = await procs.run(call, procs.folder_of, call, await _pid_of(call, req.process))
    await procs.run(call, procs.write_stdin, call, folder, _input(req.input))
    return pb.SendInputResponse()


async def stream_input(reqs: AsyncIterator[Any], call: Call, ctx: RequestContext) -> Any:
    folder = None
    async for req in reqs:
        kind = req.WhichOneof("event")
        if kind == "start":
            folder = await procs.run(call, procs.folder_of, call, await _pid_of(call, req.start.process))
        elif kind == "data":
            if folder is None:
                raise ConnectError(Code.INVALID_ARGUMENT, "the input stream must start with a start event")
            await procs.run(call, procs.write_stdin, call, folder, _input(req.data.input))
    return pb.StreamInputResponse()


async def close_stdin(req: Any, call: Call, ctx: RequestContext) -> Any:
    folder = await procs.run(call, procs.folder_of, call, await _pid_of(call, req.process))
    await procs.run(call, procs.close_stdin, call, folder)
    return pb.CloseStdinResponse()


async def update(req: Any, call: Call, ctx: RequestContext) -> Any:
    pid = await _pid_of(call, req.process)
    folder = await procs.run(call, procs.folder_of, call, pid)
    if req.HasField("pty"):
        rows, cols = req.pty.size.rows, req.pty.size.cols
        _check_size(rows, cols)
        await procs.run(call, procs.resize, call, folder, pid, rows, cols)
    return pb.UpdateResponse()


def app() -> Any:
    return service_app(pb.DESCRIPTOR.services_by_name["Process"],
                       unary={"List": list_, "SendSignal": send_signal, "SendInput": send_input,
                              "CloseStdin": close_stdin, "Update": update},
                       streams={"Start": start, "Connect": connect}, clients={"StreamInput": stream_input})
