"""SWE-ReX's remote-runtime endpoints over one workspace: ``/swerex/{workspace_id}/...``.

``swerex.runtime.remote.RemoteRuntime(host=f"{url}/swerex/{ws_id}", auth_token=token)``
(``port`` left unset: the client appends it to the host, path included) and SWE-agent
through it work unchanged: ``is_alive``, ``create_session``, ``run_in_session``,
``close_session``, ``execute``, ``read_file``, ``write_file``, ``upload``, ``close``, with
SWE-ReX's request and response models (:mod:`bunshin.api.swerex`). The token is the
server's own, sent in SWE-ReX's ``X-API-Key`` header (a wrong or missing one: 401
``{"detail": ...}``, as SWE-ReX answers). Errors come back in SWE-ReX's shape (511 and
the class path its client raises again): ``CommandTimeoutError``, ``NonZeroExitCodeError``
(``check``), ``SessionExistsError``, ``SessionDoesNotExistError``,
``BashIncorrectSyntaxError``, ``FileNotFoundError``; any other bunshin error as
``SwerexException`` with bunshin's code and hint in ``extra_info``.

How SWE-ReX's terms map onto bunshin's:

- A named session is one of the workspace's persistent sessions (``ws.sessions``). The
  names are kept in a small file inside the workspace (:data:`SESSIONS_FILE`), so a fork's
  clones answer to the same names, each in its own copy of the shell. A workspace can
  rewrite that file; it can only point its own names at its own sessions.
- A session run is interrupted by the workspace's agent at its timeout, so an interrupt
  action finds nothing running and answers at once. Interactive commands (``expect``,
  ``is_interactive_*``) are refused: a run always waits for the command's end.
- ``execute`` runs a one-shot command; ``env`` is added to the workspace's environment.
- ``upload`` writes a file, or a zip (SWE-ReX zips folders) member by member, through the
  workspace's file API (inside the workspace, never a host path): members with an absolute
  path or ``..`` are refused, links are written as files, modes keep only the rwx bits, and
  the sizes are capped.
- ``close`` closes the sessions this API opened; the workspace stays (its owner removes it).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import lzma
import posixpath
import shlex
import struct
import traceback
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ..api import swerex as x
from ..errors import BunshinError, NotFound, PathNotFound, WorkspaceNotFound
from ..runtime.kernel.limits import MAX_TEXT_FILE_BYTES
from ..workspace import Workspace
from .context import MAX_FILE_BYTES, RAW_BODY, STREAM_CHUNK, ServerContext

#: Where a workspace keeps its SWE-ReX session names (name -> bunshin session id).
SESSIONS_FILE = "/run/bunshin-swerex/sessions.json"
_MAX_NAMES_BYTES = 1 << 16
#: An upload's body, and a zip's members when unpacked, at most this many bytes.
MAX_UPLOAD_BYTES = MAX_FILE_BYTES
MAX_ZIP_MEMBERS = 100_000
_MERGED = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh"]


class Transfer(Exception):
    """An error answered in SWE-ReX's shape: its client raises ``class_path(message)``."""

    def __init__(self, class_path: str, message: str, **extra_info: Any) -> None:
        super().__init__(message)
        self.class_path, self.message, self.extra_info = class_path, message, extra_info

    @classmethod
    def swerex(cls, name: str, message: str, **extra_info: Any) -> Transfer:
        return cls(f"swerex.exceptions.{name}", message, **extra_info)

    @classmethod
    def of(cls, exc: BunshinError) -> Transfer:
        if isinstance(exc, PathNotFound):
            return cls("builtins.FileNotFoundError", exc.message)
        hint = f" ({exc.hint})" if exc.hint else ""
        return cls.swerex("SwerexException", f"{exc.message}{hint}", code=exc.code, hint=exc.hint,
                          details=exc.details)

    def response(self) -> JSONResponse:
        body = x.ExceptionTransfer(message=self.message, class_path=self.class_path,
                                   traceback="".join(traceback.format_exception(self)), extra_info=self.extra_info)
        return JSONResponse({"swerexception": body.model_dump()}, status_code=511)


def answer(fn: Callable[[], BaseModel]) -> Response:
    """``fn()``'s model as JSON, or its error in SWE-ReX's shape."""
    try:
        return JSONResponse(fn().model_dump())
    except Transfer as t:
        return t.response()
    except BunshinError as e:
        return Transfer.of(e).response()


def router(ctx: ServerContext) -> APIRouter:
    def api_key(request: Request) -> None:
        given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), ctx.token.encode()):
            raise HTTPException(401, detail="Invalid API Key: send the bunshin server's token in X-API-Key "
                                            "(RemoteRuntime's auth_token)")

    r = APIRouter(prefix="/swerex/{ws_id}", dependencies=[Depends(api_key)])

    @contextmanager
    def held(ws_id: str) -> Iterator[Workspace]:
        ws = Workspace.get(ws_id, config=ctx.config)
        with ctx.locks.held(ws):
            yield ws

    @r.get("/")
    def root(ws_id: str) -> dict[str, str]:
        return {"message": "hello world"}

    @r.get("/is_alive")
    def is_alive(ws_id: str) -> x.IsAliveResponse:
        try:
            alive = Workspace.get(ws_id, config=ctx.config).is_alive()
        except WorkspaceNotFound as e:
            return x.IsAliveResponse(is_alive=False, message=str(e))
        return x.IsAliveResponse(is_alive=alive, message="" if alive else f"workspace {ws_id} is not running")

    @r.post("/create_session")
    def create_session(ws_id: str, req: x.CreateBashSessionRequest) -> Response:
        def go() -> x.CreateBashSessionResponse:
            with held(ws_id) as ws:
                names = _names(ws)
                if req.session in names:
                    raise Transfer.swerex("SessionExistsError", f"session {req.session} already exists")
                sid = ws.sessions.open("bash")
                names[req.session] = sid
                _save_names(ws, names)
                out = ""
                if req.startup_source:
                    sourced = " ; ".join(f"source {shlex.quote(p)}" for p in req.startup_source)
                    res = ws.sessions.run(sid, sourced, timeout=max(req.startup_timeout, 0.1))
                    out = res.output
                return x.CreateBashSessionResponse(output=out)
        return answer(go)

    @r.post("/run_in_session")
    def run_in_session(ws_id: str, action: x.Action) -> Response:
        def go() -> x.BashObservation:
            with held(ws_id) as ws:
                sid = _session(ws, action.session)
                if isinstance(action, x.BashInterruptAction):  # runs end at their timeout: nothing runs now
                    return x.BashObservation(output="", exit_code=0)
                return _run(ws, sid, action)
        return answer(go)

    @r.post("/close_session")
    def close_session(ws_id: str, req: x.CloseBashSessionRequest) -> Response:
        def go() -> x.CloseBashSessionResponse:
            with held(ws_id) as ws:
                names = _names(ws)
                sid = _session(ws, req.session, names)
                try:
                    ws.sessions.close(sid)
                except NotFound:
                    pass  # already gone (it exited): forget the name all the same
                del names[req.session]
                _save_names(ws, names)
                return x.CloseBashSessionResponse()
        return answer(go)

    @r.post("/execute")
    def execute(ws_id: str, req: x.Command) -> Response:
        def go() -> x.CommandResponse:
            with held(ws_id) as ws:
                return _execute(ws, req)
        return answer(go)

    @r.post("/read_file")
    def read_file(ws_id: str, req: x.ReadFileRequest) -> Response:
        def go() -> x.ReadFileResponse:
            with held(ws_id) as ws:
                data = ws.files.read(req.path, length=MAX_TEXT_FILE_BYTES + 1)  # no more than is answered
            if len(data) > MAX_TEXT_FILE_BYTES:
                raise Transfer("builtins.ValueError", f"{req.path} is larger than the {MAX_TEXT_FILE_BYTES >> 20} MiB "
                               "read_file answers: read it in parts (head -c, tail -c) or copy it out "
                               "(bunshin's GET /v1/workspaces/{id}/files/content streams it)")
            try:
                return x.ReadFileResponse(content=data.decode(req.encoding or "utf-8", req.errors or "strict"))
            except LookupError as e:
                raise Transfer("builtins.LookupError", str(e)) from None
            except UnicodeDecodeError as e:
                raise Transfer("builtins.ValueError", f"{req.path}: {e}") from None
        return answer(go)

    @r.post("/write_file")
    def write_file(ws_id: str, req: x.WriteFileRequest) -> Response:
        def go() -> x.Empty:
            with held(ws_id) as ws:
                ws.files.write(req.path, req.content)
            return x.Empty()
        return answer(go)

    @r.post("/upload", max_body_size=RAW_BODY)
    async def upload(ws_id: str, request: Request) -> Response:
        size = request.headers.get("content-length", "")
        if not size.isdigit():  # a body of unknown length would be spooled to the host's disk unbounded
            return Transfer("builtins.ValueError", "upload without a Content-Length: refused").response()
        if int(size) > MAX_UPLOAD_BYTES + (1 << 20):
            return Transfer("builtins.ValueError", f"upload over {MAX_UPLOAD_BYTES} bytes").response()
        transfers = ctx.config.paths.transfers
        transfers.mkdir(mode=0o700, parents=True, exist_ok=True)
        with ctx.uploads.open(transfers, what="SWE-ReX") as budget:  # Starlette spools the parts on disk
            try:
                budget.check(int(size))
            except BunshinError as e:
                return Transfer.of(e).response()
            form = await request.form(max_files=1, max_fields=8)
            try:
                file, target = form.get("file"), form.get("target_path")
                if isinstance(file, str) or file is None or not isinstance(target, str) or not target:
                    return Transfer("builtins.ValueError",
                                    "upload needs a 'file' part and a 'target_path' field").response()
                unzip = str(form.get("unzip", "false")).lower() in ("true", "1", "yes", "on")
                src = file.file  # spooled by Starlette: read from it a piece at a time, never whole

                def go() -> x.Empty:
                    src.seek(0)
                    with held(ws_id) as ws:
                        if unzip:
                            _unzip(ws, src, target)
                        else:
                            ws.files.write_stream(target, iter(lambda: src.read(STREAM_CHUNK), b""))
                    return x.Empty()
                return await anyio.to_thread.run_sync(answer, go)
            finally:
                await form.close()

    @r.post("/close")
    def close(ws_id: str) -> Response:
        def go() -> x.Empty:
            with held(ws_id) as ws:
                for sid in _names(ws).values():
                    try:
                        ws.sessions.close(sid)
                    except NotFound:
                        pass
                _save_names(ws, {})
            return x.Empty()
        return answer(go)

    return r


# --- sessions ------------------------------------------------------------------------------


def _names(ws: Workspace) -> dict[str, str]:
    """The workspace's session names (written by this API; empty if absent or unreadable)."""
    try:
        raw = ws.files.read(SESSIONS_FILE, length=_MAX_NAMES_BYTES)
        data = json.loads(raw)
    except (PathNotFound, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _save_names(ws: Workspace, names: dict[str, str]) -> None:
    ws.files.write(SESSIONS_FILE, json.dumps(names), mode=0o600)


def _session(ws: Workspace, name: str, names: dict[str, str] | None = None) -> str:
    sid = (names if names is not None else _names(ws)).get(name)
    if sid is None:
        raise Transfer.swerex("SessionDoesNotExistError", f"session {name!r} does not exist")
    return sid


def _run(ws: Workspace, sid: str, action: x.BashAction) -> x.BashObservation:
    if action.is_interactive_command or action.is_interactive_quit or action.expect:
        raise Transfer.swerex("SwerexException", "interactive commands (expect, is_interactive_*) are not "
                              "supported on bunshin sessions: a run waits for the command to end",
                              hint="run the program non-interactively, with a timeout")
    check = ws.commands.run(["bash", "-n"], stdin=action.command, timeout=30)
    if check.exit_code not in (0, 126, 127):  # 126/127: no bash in this image, no check
        raise Transfer.swerex(
            "BashIncorrectSyntaxError",
            f"Error (exit code {check.exit_code}) while checking bash command \n{action.command!r}\n"
            f"---- Stderr ----\n{check.stderr}\n---- Stdout ----\n{check.stdout}",
            bash_stdout=check.stdout, bash_stderr=check.stderr)
    try:
        res = ws.sessions.run(sid, action.command, timeout=action.timeout)
    except NotFound:
        raise Transfer.swerex("SessionDoesNotExistError", f"session {action.session!r} does not exist") from None
    if res.timed_out:
        raise Transfer.swerex("CommandTimeoutError", f"timeout after {action.timeout} seconds while running "
                              f"command {action.command!r}", output=res.output)
    if action.check == "raise" and res.exit_code != 0:
        msg = f"Command {action.command!r} failed with exit code {res.exit_code}. Here is the output:\n{res.output!r}"
        raise Transfer.swerex("NonZeroExitCodeError", f"{action.error_msg}: {msg}" if action.error_msg else msg)
    exit_code = None if action.check == "ignore" else res.exit_code
    return x.BashObservation(output=res.output, exit_code=exit_code)


# --- one-shot commands and files -------------------------------------------------------------


def _execute(ws: Workspace, req: x.Command) -> x.CommandResponse:
    cmd = req.command
    if req.shell:
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else ["/bin/sh", "-c", *cmd]
    else:
        argv = [cmd] if isinstance(cmd, str) else list(cmd)
    if req.merge_output_streams:
        argv = [*_MERGED, *argv]
    res = ws.commands.run(argv, timeout=req.timeout, cwd=req.cwd, env=req.env, text=False)
    if res.timed_out:
        raise Transfer.swerex("CommandTimeoutError", f"Timeout ({req.timeout}s) exceeded while running command")
    out = x.CommandResponse(stdout=res.stdout.decode(errors="backslashreplace"),
                            stderr=res.stderr.decode(errors="backslashreplace"), exit_code=res.exit_code)
    if req.check and res.exit_code != 0:
        msg = (f"Command {cmd!r} failed with exit code {res.exit_code}. "
               f"Stdout:\n{out.stdout!r}\nStderr:\n{out.stderr!r}")
        raise Transfer.swerex("NonZeroExitCodeError", f"{req.error_msg}: {msg}" if req.error_msg else msg)
    return out


def _member_path(target: str, name: str) -> str:
    """Where zip member ``name`` goes under ``target``; refuses names that leave it."""
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or ".." in parts or not name.strip("/"):
        raise Transfer("builtins.ValueError", f"zip member {name!r} leaves the target folder: refused")
    return posixpath.join(target, posixpath.normpath(name))


#: What reading a zip that lies (about its CRCs, sizes, offsets, compression or encryption)
#: raises from Python's ``zipfile`` and its decompressors.
_ZIP_LIES = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, RuntimeError, EOFError, OSError,
             ValueError, struct.error, zlib.error, lzma.LZMAError)


@contextmanager
def _lying_zip() -> Iterator[None]:
    """A zip's lies as SWE-ReX's ``BadZipFile`` (a bad request, never the server's failure)."""
    try:
        yield
    except (Transfer, BunshinError):  # ours, and the workspace's (some are ValueError or OSError too)
        raise
    except _ZIP_LIES as e:
        raise Transfer("zipfile.BadZipFile", f"upload with unzip: a damaged or unreadable zip ({e})") from None


def _unzip(ws: Workspace, src: IO[bytes], target: str) -> None:
    """Unpack a zip into ``target`` through the workspace's file API (all members checked first),
    each member streamed a piece at a time; a member that lies is removed again."""
    with _lying_zip():
        zf = zipfile.ZipFile(src)
    with zf:
        members = zf.infolist()
        if len(members) > MAX_ZIP_MEMBERS:
            raise Transfer("builtins.ValueError", f"zip of {len(members)} members (at most {MAX_ZIP_MEMBERS})")
        if sum(m.file_size for m in members) > MAX_UPLOAD_BYTES:
            raise Transfer("builtins.ValueError", f"zip unpacks to over {MAX_UPLOAD_BYTES} bytes")
        plan = [(m, _member_path(target, m.filename)) for m in members]
        folders = [target] + [p for m, p in plan if m.is_dir()]
        made = ws.commands.run(["mkdir", "-p", "--", *folders], timeout=60)
        if not made.ok:
            raise Transfer("builtins.OSError", f"mkdir in {target}: {made.stderr.strip()}")
        for m, path in plan:
            if m.is_dir():
                continue
            mode = (m.external_attr >> 16) & 0o777
            try:
                with _lying_zip(), zf.open(m) as f:
                    ws.files.write_stream(path, _member_pieces(f, m), mode=mode or None)
            except Transfer:
                with contextlib.suppress(BunshinError):
                    ws.files.remove(path)
                raise


def _member_pieces(f: IO[bytes], m: zipfile.ZipInfo) -> Iterator[bytes]:
    """A member's bytes a piece at a time, never more than its header says (nor fewer)."""
    got = 0
    while piece := f.read(min(STREAM_CHUNK, m.file_size + 1 - got)):
        got += len(piece)
        if got > m.file_size:
            break
        yield piece
    if got != m.file_size:
        raise Transfer("builtins.ValueError", f"zip member {m.filename!r} is not the size it says")
