"""envd's processes as files in the workspace: how a command runs and how it is followed.

The host holds no connection into a workspace across calls (CRIU could not checkpoint
it), so a command started by ``Process/Start`` runs under a small ``sh`` wrapper spawned by
the agent: the command's stdout and stderr go to files in
``/tmp/.bunshin-e2b/procs/<run>/``, its stdin comes from a FIFO there (or ``/dev/null``),
and its exit status is written there when it ends (as the name of an empty file,
``rc=<status>``: a listing sees it whole). The command leads a session of its own
(``setsid``), so a signal to its process group reaches all it started, and the wrapper
outlives it to record the status. ``by-pid/<pid>`` links to the run's folder: the pid
is the command's, as E2B's SDK knows it. The server follows the files with short agent
calls (:class:`Follow`); between two of them no connection is open, so a sandbox holding
a running command forks, and each clone carries the command and its files on.
Everything here is the workspace's own: what it does to these files changes only what it
is told of its own commands.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shlex
import signal
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ....errors import InvalidArgument, NotFound, PathNotFound
from ....runtime.agent_host.bundle import AgentBundle
from ..sandboxes import sandbox_envs
from .rpc import Call

#: The PTY relay's source, run by the agent's Python inside the workspace.
RELAY = (Path(__file__).parent / "ptyrelay.py").read_text()

BASE = "/tmp/.bunshin-e2b/procs"
BY_PID = f"{BASE}/by-pid"
#: Bytes of output read in one agent call; the host holds at most this much per stream.
CHUNK = 1 << 20
#: Largest stdin piece ``SendInput`` takes (the SDK sends what the user gave in one).
MAX_INPUT = 1 << 20
T = TypeVar("T")

#: The wrapper: ``sh -c WRAPPER bunshin-e2b <folder> <argv...>``; BUNSHIN_E2B_META and
#: BUNSHIN_E2B_STDIN in its environment, both removed before the command runs.
WRAPPER = r"""
d="$1"; shift; u=0
mkdir -p "$d" "${d%/*}/by-pid" || exit 126
printf '%s' "$BUNSHIN_E2B_META" > "$d/meta"; unset BUNSHIN_E2B_META
: > "$d/out"; : > "$d/err"; echo "$$" > "$d/wpid"
if [ -n "$BUNSHIN_E2B_STDIN" ]; then
  mkfifo -m 600 "$d/in" && exec 3<>"$d/in" || exit 126
  trap 'exec 3<&-; u=1' USR1
  i="$d/in"
else
  i=/dev/null
fi
unset BUNSHIN_E2B_STDIN
if command -v setsid >/dev/null 2>&1; then set -- setsid "$@"; fi
"$@" <"$i" >"$d/out" 2>"$d/err" 3<&- &
c=$!
ln -sfn "$d" "${d%/*}/by-pid/$c"; echo "$c" > "$d/pid"
wait "$c"; rc=$?
while [ "$u" = 1 ] && [ "$rc" = 138 ]; do  # 128 + SIGUSR1: the wait was cut by CloseStdin's signal
  u=0; wait "$c"; r=$?; [ "$r" = 127 ] && break; rc=$r
done
: > "$d/rc=$rc"
"""


@dataclass(frozen=True)
class Spec:
    """What ``Start`` asked for."""

    cmd: str
    args: tuple[str, ...]
    envs: dict[str, str]
    cwd: str | None
    tag: str | None
    stdin: bool
    pty: tuple[int, int] | None = None  # rows, cols


async def run(call: Call, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn(*args)`` in a thread of the sandbox's share of the pool (``RateLimited`` when too
    many of its calls wait for one: :mod:`....shares`), holding the sandbox's lock (a fork
    waits for it, and it for a fork)."""
    return await _locked(call, True, fn, *args, **kw)


async def poll(call: Call, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """:func:`run` for a stream let in already (a poll of its command or folder) or a
    clean-up: it waits its turn, never refused."""
    return await _locked(call, False, fn, *args, **kw)


async def _locked(call: Call, refuse: bool, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    def locked() -> T:
        with call.ctx.locks.held(call.ws):
            return fn(*args, **kw)
    return await call.ctx.shares.run(call.ws.id, locked, refuse=refuse)


def user_argv(call: Call, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` run as the call's user (``setpriv``), and that user's HOME/USER; root as is."""
    user = call.user
    if user in (None, "root"):
        return argv, {"HOME": "/root", "USER": "root"}
    uid, gid, home = passwd_entry(call, user)
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--", *argv], \
        {"HOME": home, "USER": user, "LOGNAME": user}


def passwd_entry(call: Call, user: str) -> tuple[int, int, str]:
    """``user``'s uid, gid and home from the workspace's /etc/passwd (blocking)."""
    try:
        text = call.ws.files.read("/etc/passwd", length=1 << 20).decode(errors="replace")
    except PathNotFound:
        text = ""
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 6 and f[0] == user and f[2].isdigit() and f[3].isdigit():
            return int(f[2]), int(f[3]), f[5] or "/"
    raise InvalidArgument(f"user {user!r} does not exist in the sandbox",
                          hint="run as root (the default) or create the user first (useradd)")


def give_to_user(call: Call, path: str) -> None:
    """Make ``path`` the call's user's (blocking); root's stays as it is."""
    if call.user in (None, "root"):
        return
    uid, gid, _ = passwd_entry(call, call.user)
    r = call.ws.exec(["chown", "-h", f"{uid}:{gid}", "--", path], timeout=30)
    if r.exit_code != 0:
        raise InvalidArgument(f"cannot give {path} to {call.user}: {r.stderr.strip()[:200]}")


def start(call: Call, spec: Spec) -> str:
    """Spawn ``spec`` under the wrapper (blocking); the run's folder."""
    folder = f"{BASE}/{uuid.uuid4().hex}"
    argv, user_env = user_argv(call, [spec.cmd, *spec.args])
    extra: dict[str, str] = {}
    if spec.pty is not None:  # the relay (the agent's own Python) holds the terminal
        rows, cols = spec.pty
        agent = AgentBundle(Path())
        argv = [*agent.argv[:4], "-s", "-B", "-c", RELAY, f"{folder}/size", str(rows), str(cols), *argv]
        extra = {"PYTHONHOME": agent.env["PYTHONHOME"], "PYTHONDONTWRITEBYTECODE": "1"}
    meta = json.dumps({"cmd": spec.cmd, "args": list(spec.args), "envs": spec.envs, "cwd": spec.cwd,
                       "tag": spec.tag, "pty": spec.pty is not None})
    # the sandbox's envVars (from its create), then the command's own
    env = {**user_env, **sandbox_envs(call.ctx.config, call.ws.id), **spec.envs, **extra, "BUNSHIN_E2B_META": meta,
           "BUNSHIN_E2B_STDIN": "1" if spec.stdin or spec.pty else ""}
    call.ws.commands.spawn(["/bin/sh", "-c", WRAPPER, "bunshin-e2b", folder, *argv], cwd=spec.cwd, env=env)
    return folder


def folder_of(call: Call, pid: int) -> str:
    """The run folder of the command with ``pid`` (blocking); ``NotFound`` for none running."""
    folder = f"{BY_PID}/{pid}"
    try:
        call.ws.files.read(f"{folder}/pid", length=32)
    except PathNotFound:
        raise NotFound(f"process with pid {pid} not found", hint="list them with commands.list()") from None
    return folder


def status_of(names: Iterable[str]) -> int | None:
    """The exit status a run's folder holds (the file ``rc=<status>``: one name, never half
    written), or ``None`` while it runs."""
    for name in names:
        if name.startswith("rc=") and name[3:].isdigit():
            return int(name[3:])
    return None


def meta_of(call: Call, folder: str) -> dict[str, Any]:
    """What started the command in ``folder`` (blocking)."""
    try:
        meta = json.loads(call.ws.files.read(f"{folder}/meta", length=1 << 20) or b"{}")
    except (PathNotFound, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def listing(call: Call) -> list[tuple[int, dict[str, Any]]]:
    """Every command still running: its pid and what started it (blocking)."""
    try:
        pids = call.ws.files.list(BY_PID)
    except PathNotFound:
        return []
    found = []
    for e in pids:
        if not e.name.isdigit():
            continue
        folder = f"{BY_PID}/{e.name}"
        names = {f.name for f in entries(call, folder)}
        if status_of(names) is not None or "meta" not in names:
            continue
        try:
            meta = json.loads(call.ws.files.read(f"{folder}/meta", length=1 << 20))
        except (PathNotFound, ValueError):
            continue
        if isinstance(meta, dict):
            found.append((int(e.name), meta))
    return found


def entries(call: Call, folder: str) -> list[Any]:
    try:
        return call.ws.files.list(folder)
    except PathNotFound:
        return []


def write_stdin(call: Call, folder: str, data: bytes) -> None:
    """Append ``data`` to the command's stdin (its FIFO; blocking)."""
    if len(data) > MAX_INPUT:
        raise InvalidArgument(f"stdin piece of {len(data)} bytes is over {MAX_INPUT}", hint="send it in parts")
    names = {f.name for f in entries(call, folder)}
    if "in" not in names:
        raise InvalidArgument("the process was started without stdin",
                              hint="pass stdin=True to commands.run (background) to write to it")
    if status_of(names) is not None:
        raise NotFound("the process has ended", hint="start it again")
    fifo = shlex.quote(f"{folder}/in")
    # O_NONBLOCK write end: the wrapper holds the FIFO open both ways, so it never blocks on open
    result = call.ws.exec(["/bin/sh", "-c", f"base64 -d > {fifo}"], stdin=base64.b64encode(data).decode(),
                          timeout=30)
    if result.exit_code != 0:
        raise InvalidArgument(f"cannot write to the process's stdin: {result.stderr.strip()[:200]}")


def close_stdin(call: Call, folder: str) -> None:
    """Let the command read the end of its stdin (blocking): the wrapper lets go of the FIFO."""
    names = {f.name for f in entries(call, folder)}
    if "in" not in names:
        raise InvalidArgument("the process was started without stdin")
    wpid = call.ws.files.read(f"{folder}/wpid", length=32).decode().strip()
    if wpid.isdigit():
        call.ws.commands.kill(int(wpid), signal.SIGUSR1)


def resize(call: Call, folder: str, pid: int, rows: int, cols: int) -> None:
    """Set the terminal of a PTY command to ``rows`` x ``cols`` (blocking)."""
    if not meta_of(call, folder).get("pty"):
        raise InvalidArgument(f"process {pid} has no PTY to resize")
    call.ws.files.write(f"{folder}/size", f"{rows} {cols}\n")
    call.ws.commands.kill(pid, signal.SIGWINCH)


def remove(call: Call, folder: str, pid: int) -> None:
    """Forget an ended command's files (blocking)."""
    link = f"{BY_PID}/{pid}"
    real = folder if not folder.startswith(BY_PID + "/") else None
    if real is None:  # the folder named through its link: the run's own folder is where it points
        real = next((e.link_target for e in call.ws.files.list(BY_PID) if e.name == str(pid) and e.link_target), None)
    for path, recursive in ((link, False), (real, True)):
        if path and path.startswith(BASE + "/"):  # never anything else, whatever the link says
            with contextlib.suppress(PathNotFound):
                call.ws.files.remove(path, recursive=recursive)
