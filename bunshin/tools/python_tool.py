"""The ``python`` tool: a persistent interpreter living inside the workspace.

A small REPL server (``_SERVER``) runs in the workspace as an ordinary process
listening on a unix socket in ``/run/bunshin-tools``; each call is one short
``python3 -c _CLIENT`` exec that starts the server if needed, sends the code,
and prints the answer as JSON. Because the interpreter is a process of the
workspace, its globals are forked and snapshotted with everything else, and no
connection is open between calls. Like the interactive prompt, the value of a
trailing expression is printed. A call past its timeout gets SIGINT
(``KeyboardInterrupt``); an interpreter that ignores it is killed and the next
call starts a fresh one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import BunshinError
from .builtin import translate
from .spec import Tool, ToolContext, ToolError, ToolOutput, ToolSpec

TOOL_DIR = "/run/bunshin-tools"

_SERVER = r'''
import ast, json, os, signal, socket, sys, traceback
DIR = sys.argv[1]
SOCK, OUT = os.path.join(DIR, "py.sock"), os.path.join(DIR, "py.out")
sys.path[0] = ""
ns = {"__name__": "__main__", "__builtins__": __builtins__}
signal.signal(signal.SIGINT, signal.default_int_handler)

def run(code):
    try:
        tree = ast.parse(code, "<python>", "exec")
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, "<python>", "exec"), ns)
        if last is not None:
            value = eval(compile(last, "<python>", "eval"), ns)
            if value is not None:
                print(repr(value))
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        kind, err, tb = sys.exc_info()
        traceback.print_exception(kind, err, tb.tb_next)
        return 1

def execute(code):
    fd = os.open(OUT, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(); sys.stderr.flush()
    os.dup2(fd, 1); os.dup2(fd, 2)
    status, interrupted = 1, False
    try:
        status = run(code)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            sys.stdout.flush(); sys.stderr.flush()
        except Exception:
            pass
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        os.close(saved[0]); os.close(saved[1])
    os.lseek(fd, 0, 0)
    chunks = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        chunks.append(b)
    os.close(fd)
    return status, b"".join(chunks).decode("utf-8", "replace"), interrupted

def main():
    try:
        os.unlink(SOCK)
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(SOCK)
    srv.listen(8)
    while True:
        try:
            conn, _ = srv.accept()
        except KeyboardInterrupt:
            continue
        try:
            with conn:
                buf = b""
                while not buf.endswith(b"\n"):
                    b = conn.recv(1 << 20)
                    if not b:
                        break
                    buf += b
                req = json.loads(buf)
                conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
                status, output, interrupted = execute(req["code"])
                reply = {"output": output, "exit_code": status, "interrupted": interrupted}
                conn.sendall(json.dumps(reply).encode() + b"\n")
        except (KeyboardInterrupt, OSError, ValueError):
            continue

main()
'''

_CLIENT = r'''
import json, os, signal, socket, subprocess, sys, time
DIR, WORKDIR, SERVER = sys.argv[1], sys.argv[2], sys.argv[3]
SOCK = os.path.join(DIR, "py.sock")
req = json.loads(sys.stdin.read())

def connect():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(SOCK)
    return s

try:
    s = connect()
except OSError:
    os.makedirs(DIR, mode=0o700, exist_ok=True)
    path = os.path.join(DIR, "pyrepl.py")
    with open(path, "w") as f:
        f.write(SERVER)
    cwd = WORKDIR if os.path.isdir(WORKDIR) else "/"
    subprocess.Popen([sys.executable, "-u", path, DIR], cwd=cwd, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 10
    while True:
        try:
            s = connect()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit("the python interpreter did not start")
            time.sleep(0.01)

buf = b""

def readline(timeout):
    global buf
    s.settimeout(timeout)
    while b"\n" not in buf:
        b = s.recv(1 << 20)
        if not b:
            raise ConnectionError("the interpreter went away")
        buf += b
    line, _, buf = buf.partition(b"\n")
    return line

s.sendall(json.dumps({"code": req["code"]}).encode() + b"\n")
pid = json.loads(readline(10))["pid"]
timed_out = False
try:
    line = readline(req["timeout"])
except (socket.timeout, TimeoutError):
    timed_out = True
    os.kill(pid, signal.SIGINT)
    try:
        line = readline(3)
    except (socket.timeout, TimeoutError):
        os.kill(pid, signal.SIGKILL)
        os.unlink(SOCK)
        line = json.dumps({"output": "(the interpreter did not stop; it was restarted)\n",
                           "exit_code": None}).encode()
reply = json.loads(line)
reply["timed_out"] = timed_out or reply.pop("interrupted", False)
if reply["timed_out"]:
    reply["exit_code"] = None
print(json.dumps(reply))
'''


def _python(ws: Any, args: Mapping[str, Any], ctx: ToolContext) -> ToolOutput:
    req = json.dumps({"code": args["code"], "timeout": ctx.timeout})
    try:
        r = ws.exec(["python3", "-c", _CLIENT, TOOL_DIR, ctx.workdir, _SERVER],
                    stdin=req, timeout=ctx.timeout + 15)
    except BunshinError as exc:
        raise translate(exc) from None
    if r.exit_code == 127:
        raise ToolError("python3 is not installed in this workspace")
    if r.exit_code != 0 or r.timed_out:
        raise ToolError(f"the python interpreter failed: {(r.stderr or r.stdout).strip()[-2000:]}")
    reply = json.loads(r.stdout)
    return ToolOutput(reply["output"], reply["exit_code"], bool(reply["timed_out"]))


PYTHON = Tool(
    ToolSpec(
        name="python",
        description="Run Python code in a persistent interpreter (variables and imports carry over); "
        "the value of a trailing expression is printed.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "minLength": 1}},
            "required": ["code"],
            "additionalProperties": False,
        },
        timeout=300.0,
    ),
    _python,
)
