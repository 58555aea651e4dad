"""The ``python`` tool's persistent interpreter, run inside the workspace by path.

Unlike the rest of this package it runs under the *image's* ``python3`` (so the
code it is given sees the image's packages), not the agent's own Python copy,
and it imports nothing from the package: it must run on any Python >= 3.7 with
the standard library only.

``python3 pyrepl.py call DIR WORKDIR`` (one per tool call) reads
``{"code", "timeout"}`` on stdin, connects to the interpreter's unix socket
``DIR/py.sock`` (starting ``pyrepl.py serve DIR`` in WORKDIR if nobody listens),
sends the code and prints the reply as one JSON line:
``{"output", "exit_code", "timed_out"}``. Past the timeout the interpreter gets
SIGINT (``KeyboardInterrupt``); one that ignores it for 3 s is killed, and the
next call starts a fresh one.

A request with ``"split": true`` (the E2B code interpreter's) keeps stdout and stderr
apart (in ``DIR/<exec_id>.out`` and ``.err`` while it runs, so a caller can read them as
they grow), reports the trailing value and an exception instead of printing them, sets
``env`` for the run only, and answers ``{"stdout", "stderr", "exit_code", "interrupted",
"result", "error", "count"}``: ``result`` the value's displays (``text/plain`` is its repr,
``text/html`` and the like from its ``_repr_*_`` methods), ``error`` its name, value and
traceback, ``count`` the interpreter's runs so far. The interpreter's pid is in ``DIR/py.pid``.

The interpreter (``serve``) is an ordinary process of the workspace, so its
globals are forked and snapshotted with everything else, and no connection is
open between calls. Like the interactive prompt, it prints the value of a
trailing expression. Run by path, Python puts this folder first on
``sys.path`` while the standard library is imported; no module here may be
named like a standard-library one (a test holds it).
"""

from __future__ import annotations

import ast
import base64
import builtins
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

SOCKET_NAME = "py.sock"
OUTPUT_NAME = "py.out"
PID_NAME = "py.pid"
#: Most of each stream a split reply carries (the rest is cut, with a note).
SPLIT_MAX_CHARS = 4 << 20
#: Displays of a trailing value, by MIME type, from its ``_repr_*_`` methods.
_DISPLAYS = (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
             ("image/svg+xml", "_repr_svg_"), ("image/png", "_repr_png_"), ("image/jpeg", "_repr_jpeg_"),
             ("text/latex", "_repr_latex_"), ("application/json", "_repr_json_"))
START_TIMEOUT_S = 10.0
INTERRUPT_GRACE_S = 3.0
_CHUNK = 1 << 20
_NAME = "<python>"


# --- the interpreter ---------------------------------------------------------------


def run(code: str, ns: dict[str, Any], outcome: dict[str, Any] | None = None) -> int:
    """Run ``code`` in ``ns`` like the interactive prompt; its exit status. With ``outcome``
    the trailing value goes to ``outcome["value"]`` and an exception to ``outcome["error"]``
    instead of being printed."""
    try:
        tree = ast.parse(code, _NAME, "exec")
    except SyntaxError:
        _report(sys.exc_info(), outcome, limit=0)
        return 1
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    try:
        exec(compile(tree, _NAME, "exec"), ns)
        if last is not None:
            value = eval(compile(last, _NAME, "eval"), ns)
            if value is not None and outcome is not None:
                outcome["value"] = value
            elif value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        if outcome is not None and e.code not in (None, 0):
            _report(sys.exc_info(), outcome)
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        kind, err, tb = sys.exc_info()
        # the traceback starts at the user's code, not at this frame
        _report((kind, err, tb.tb_next if tb is not None else None), outcome)
        return 1


def _report(info: Any, outcome: dict[str, Any] | None, limit: int | None = None) -> None:
    """Print an exception's traceback, or put it in ``outcome["error"]``."""
    kind, err, tb = info
    if outcome is None:
        traceback.print_exception(kind, err, tb, limit=limit)
        return
    outcome["error"] = {"name": kind.__name__, "value": str(err),
                        "traceback": "".join(traceback.format_exception(kind, err, tb, limit=limit))}


def displays(value: Any) -> dict[str, Any]:
    """A value's displays by MIME type: ``text/plain`` (its repr) and those its ``_repr_*_``
    methods give (a method that fails or gives nothing is skipped)."""
    out: dict[str, Any] = {}
    for mime, method in _DISPLAYS:
        fn = getattr(value, method, None)
        if not callable(fn) or isinstance(value, type):
            continue
        try:
            data = fn()
        except Exception:
            continue
        if isinstance(data, tuple):  # (data, metadata)
            data = data[0]
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode()
        if data is not None:
            out[mime] = data
    try:
        out["text/plain"] = repr(value)
    except Exception as e:
        out["text/plain"] = f"<repr failed: {type(e).__name__}: {e}>"
    return out


def _flush_std() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _drain(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while True:
        b = os.read(fd, _CHUNK)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


def execute(code: str, ns: dict[str, Any], out_path: str, err_path: str | None = None,
            outcome: dict[str, Any] | None = None) -> tuple[int, str, bool, str]:
    """Run ``code`` with fd 1 on ``out_path`` and fd 2 on ``err_path`` (else on ``out_path``
    too; children's output lands there as well): ``(status, output, interrupted, errors)``."""
    fd = os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    efd = fd if err_path is None else os.open(err_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    saved = os.dup(1), os.dup(2)
    _flush_std()
    os.dup2(fd, 1)
    os.dup2(efd, 2)
    status, interrupted = 1, False
    try:
        status = run(code, ns, outcome)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            _flush_std()
        except Exception:
            pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    errors = "" if efd == fd else _drain(efd)
    return status, _drain(fd), interrupted, errors


def _cut(text: str) -> str:
    if len(text) <= SPLIT_MAX_CHARS:
        return text
    return text[:SPLIT_MAX_CHARS] + f"\n[output cut at {SPLIT_MAX_CHARS} characters]\n"


def _split_run(req: dict[str, Any], ns: dict[str, Any], run_dir: str, count: int) -> dict[str, Any]:
    """One run of a split request (see the module's docstring)."""
    base = os.path.join(run_dir, os.path.basename(str(req.get("exec_id") or "run")))
    env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    outcome: dict[str, Any] = {}
    try:
        status, out, interrupted, err = execute(req["code"], ns, base + ".out", base + ".err", outcome)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for suffix in (".out", ".err"):
            try:
                os.unlink(base + suffix)
            except OSError:
                pass
    result = displays(outcome["value"]) if "value" in outcome else None
    return {"stdout": _cut(out), "stderr": _cut(err), "exit_code": status, "interrupted": interrupted,
            "result": result, "error": outcome.get("error"), "count": count}


def _answer(conn: socket.socket, ns: dict[str, Any], run_dir: str, count: int) -> None:
    buf = b""
    while not buf.endswith(b"\n"):
        b = conn.recv(_CHUNK)
        if not b:
            break
        buf += b
    req = json.loads(buf)
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    if req.get("split"):
        reply = _split_run(req, ns, run_dir, count)
    else:
        status, output, interrupted, _ = execute(req["code"], ns, os.path.join(run_dir, OUTPUT_NAME))
        reply = {"output": output, "exit_code": status, "interrupted": interrupted}
    conn.sendall(json.dumps(reply).encode() + b"\n")


def serve(run_dir: str) -> None:
    """Listen on ``run_dir/py.sock`` forever, one connection (one call) at a time."""
    sock_path = os.path.join(run_dir, SOCKET_NAME)
    sys.path[0] = ""  # the user's imports resolve from the working folder, as at the prompt
    ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(8)
    with open(os.path.join(run_dir, PID_NAME), "w") as f:
        f.write(str(os.getpid()))
    count = 0
    while True:
        try:
            conn, _ = srv.accept()
        except KeyboardInterrupt:
            continue
        count += 1
        try:
            with conn:
                _answer(conn, ns, run_dir, count)
        except (KeyboardInterrupt, OSError, ValueError):
            continue


# --- one call ----------------------------------------------------------------------


class _Lines:
    """Newline-terminated messages read from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def read(self, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            b = self.sock.recv(_CHUNK)
            if not b:
                raise ConnectionError("the interpreter went away")
            self.buf += b
        line, _, self.buf = self.buf.partition(b"\n")
        return line


def _connect(sock_path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
    except OSError:
        s.close()
        raise
    return s


def _start(run_dir: str, workdir: str) -> socket.socket:
    """Start an interpreter and connect to it (exits the call if it does not listen)."""
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    cwd = workdir if os.path.isdir(workdir) else "/"
    subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "serve", run_dir], cwd=cwd,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return _connect(os.path.join(run_dir, SOCKET_NAME))
        except OSError:
            if time.monotonic() > deadline:
                sys.exit("the python interpreter did not start")
            time.sleep(0.01)


# Under Python < 3.10 socket.timeout is not TimeoutError, and this runs on the image's Python.
_TIMEOUTS = (socket.timeout, TimeoutError)  # noqa: UP041


def call(run_dir: str, workdir: str, code: str, timeout: float,
         extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``code`` in the workspace's interpreter: ``{output, exit_code, timed_out}`` (a split
    request's ``extra``: the split answer, with ``timed_out``)."""
    sock_path = os.path.join(run_dir, SOCKET_NAME)
    try:
        s = _connect(sock_path)
    except OSError:
        s = _start(run_dir, workdir)
    lines = _Lines(s)
    s.sendall(json.dumps({"code": code, **(extra or {})}).encode() + b"\n")
    pid = json.loads(lines.read(START_TIMEOUT_S))["pid"]
    timed_out = False
    try:
        line = lines.read(timeout)
    except _TIMEOUTS:
        timed_out = True
        os.kill(pid, signal.SIGINT)
        try:
            line = lines.read(INTERRUPT_GRACE_S)
        except _TIMEOUTS:
            os.kill(pid, signal.SIGKILL)
            os.unlink(sock_path)
            line = json.dumps({"output": "(the interpreter did not stop; it was restarted)\n",
                               "exit_code": None}).encode()
    reply: dict[str, Any] = json.loads(line)
    reply["timed_out"] = timed_out or reply.pop("interrupted", False)
    if reply["timed_out"]:
        reply["exit_code"] = None
    return reply


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "serve":
        serve(argv[1])
    elif len(argv) == 3 and argv[0] == "call":
        req = json.loads(sys.stdin.read())
        extra = {k: req[k] for k in ("split", "env", "exec_id") if k in req}
        print(json.dumps(call(argv[1], argv[2], req["code"], req["timeout"], extra)))
    else:
        sys.exit("usage: pyrepl.py serve DIR | pyrepl.py call DIR WORKDIR < {code, timeout}")


if __name__ == "__main__":
    main(sys.argv[1:])
