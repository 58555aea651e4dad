"""CLI commands on workspaces: create, exec, sh, ls, stats, rm."""

from __future__ import annotations

import argparse
import dataclasses
import os
import select
import sys
import termios
import time
import tty
from datetime import datetime
from typing import Any

from .. import console as output
from ..agent.execs import DEFAULT_MAX_OUTPUT
from ..api.models import StatsOut
from ..errors import InvalidArgument, PathNotFound, WorkspaceNotFound
from ..runtime.agent_host.types import ExecResult
from ..runtime.container.publish import parse as parse_publish
from ..runtime.kernel.limits import (
    DEFAULT_EXEC_TIMEOUT_S,
    MAX_OUTPUT,
    byte_size,
    check_max_output,
    check_timeout,
)
from ..workspace import Snapshot, Workspace, WorkspaceInfo
from ..workspace.batch import remove_all
from ..workspace.desktop import DesktopSpec
from . import exits, network_cmds

#: ``bunshin exec``'s exit code when the command exited 0 but its output was cut at
#: ``--max-output`` (128 + SIGPIPE: the reader stopped taking its output).
EXIT_TRUNCATED = exits.TRUNCATED

#: ``ls --filter`` keys: each compares one field of the workspace (``status`` its state).
FILTER_KEYS = ("id", "name", "status", "image", "parent")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("create", help="create a workspace and print its id")
    p.add_argument("--image", default="host",
                   help="'host' (default), a root filesystem folder, or an image (name:tag or id; pulled first "
                        "if it names its registry)")
    p.add_argument("--name", help="a name to refer to it by")
    p.add_argument("--memory", default="2G", help="memory limit, e.g. 512M, 2G (default 2G)")
    p.add_argument("--pids", type=int, default=512, help="process limit (default 512)")
    p.add_argument("--mount", action="append", default=[], metavar="HOST:PATH[:ro|rw]",
                   help="share a host folder at PATH inside (read-only unless :rw; clones share it too)")
    p.add_argument("--desktop", nargs="?", const=True, default=None, metavar="WxH[xD]",
                   help="start a desktop inside (Xvfb, jwm; default screen 1280x800x24): see `bunshin desktop`")
    p.add_argument("--vnc", action="store_true", help="with --desktop: x11vnc on the workspace's loopback")
    network_cmds.add_create_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.add_argument("cmd", nargs="*", help="-- CMD...: a long-lived command to run inside")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("exec", help="run a command in a workspace", epilog=exits.EPILOG)
    p.add_argument("workspace")
    p.add_argument("--timeout", type=float, help=f"kill the command (its whole process group) after S seconds and exit {exits.TIMED_OUT} "
                        f"(default {DEFAULT_EXEC_TIMEOUT_S:g}, at most 7 days)")
    p.add_argument("--cwd", help="working directory inside the workspace")
    p.add_argument("-e", "--env", action="append", metavar="K=V", help="set an environment variable")
    p.add_argument("--max-output", default=None, metavar="SIZE",
                   help="bytes of stdout and of stderr kept, e.g. 4M (default 1M, at most 16M); output cut "
                        f"there is marked on stderr and exits {EXIT_TRUNCATED} if the command exited 0")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of streaming it")
    p.add_argument("cmd", nargs="*", help="-- CMD...")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("sh", help="an interactive shell inside a workspace")
    p.add_argument("workspace")
    p.set_defaults(func=cmd_sh)

    p = sub.add_parser("ls", help="list workspaces")
    p.add_argument("-q", "--quiet", action="store_true", help="print the ids only")
    p.add_argument("-f", "--filter", action="append", default=[], metavar="KEY=VALUE",
                   help=f"only those matching, repeatable (all must match): {', '.join(FILTER_KEYS)}; "
                        "e.g. --filter status=running --filter parent=ws-...")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("stats", help="memory and processes of a workspace")
    p.add_argument("workspace")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("rm", help="remove workspaces, running or not (snapshots: `bunshin snapshot rm`)")
    p.add_argument("workspaces", nargs="*", metavar="WORKSPACE")
    p.add_argument("-f", "--force", action="store_true",
                   help="no error for a workspace that does not exist (removes running ones either way)")
    p.add_argument("-a", "--all", action="store_true", help="remove every workspace of this home")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_rm)


def cmd_create(args: argparse.Namespace) -> int:
    command = args.cmd or None
    desktop = DesktopSpec.parse(args.desktop)
    if args.vnc:
        if desktop is None:
            raise InvalidArgument("--vnc needs --desktop", hint="bunshin create --desktop --vnc")
        desktop = dataclasses.replace(desktop, vnc=True)
    for spec in args.publish:  # a bad one before anything is made
        parse_publish(spec)
    network = network_cmds.network_kwargs(args)
    t0 = time.perf_counter()
    what = "creating a workspace" + ("" if args.image == "host" else f" of {args.image} (pulled first if need be)")
    with output.progress(what, quiet=args.json):
        ws = Workspace.create(args.image, name=args.name, memory=args.memory, pids=args.pids, command=command,
                              mounts=args.mount, desktop=desktop, **network)
    try:
        ports = network_cmds.publish_all(ws, args.publish)
    except BaseException:
        ws.remove()
        raise
    if args.json:
        output.print_json({**output.to_jsonable(WorkspaceInfo.of(ws.record)),
                           "create_ms": round((time.perf_counter() - t0) * 1000, 1),
                           "ports": [{"port": p.port, "host": p.host, "host_port": p.host_port} for p in ports]})
    else:
        print(ws.id)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    try:
        return _exec(args)
    except CannotRun as e:
        return e.code


def _exec(args: argparse.Namespace) -> int:
    argv = args.cmd
    if not argv:
        raise InvalidArgument("no command given", hint="bunshin exec WS -- CMD [ARGS...]")
    check_timeout(args.timeout, "--timeout")
    keep = _max_output(args.max_output)
    ws = Workspace.get(args.workspace)
    kw = {"timeout": args.timeout, "cwd": args.cwd, "env": parse_env(args.env), "max_output": keep}
    # Streamed output is passed through as the exact bytes the command wrote.
    if args.json:
        output.print_json(_run(ws, argv, kw))  # stdout_truncated / stderr_truncated say if it was cut
        return 0
    res = _run(ws, argv, {**kw, "text": False})
    sys.stdout.flush()
    sys.stdout.buffer.write(res.stdout)
    sys.stdout.buffer.flush()
    sys.stderr.flush()
    sys.stderr.buffer.write(res.stderr)
    sys.stderr.buffer.flush()
    cut = [name for name, was in (("stdout", res.stdout_truncated), ("stderr", res.stderr_truncated)) if was]
    if cut:
        shown = output.human_bytes(keep if keep is not None else DEFAULT_MAX_OUTPUT)
        sys.stderr.write(f"\nbunshin: {' and '.join(cut)} cut at {shown}: the rest was dropped "
                         f"(--max-output up to {MAX_OUTPUT >> 20}M, or write it to a file and read that)\n")
    if res.timed_out:
        limit = args.timeout or DEFAULT_EXEC_TIMEOUT_S
        sys.stderr.write(f"bunshin: command timed out after {limit:g} s and was killed\n")
        return exits.TIMED_OUT
    if res.exit_code == 0 and cut:
        return EXIT_TRUNCATED
    return res.exit_code if res.exit_code >= 0 else 128 + (res.signal or 9)


class CannotRun(Exception):
    """The command could not be started: exit 127 (not found) or 126 (not executable)."""

    def __init__(self, code: int) -> None:
        self.code = code


def _run(ws: Workspace, argv: list[str], kw: dict[str, Any]) -> ExecResult[Any]:
    """``commands.run``; a command that cannot start is the command's failure (126, 127),
    as with docker, not bunshin's (125): the agent's error is printed and re-raised as ``CannotRun``."""
    try:
        return ws.commands.run(argv, **kw)
    except (PathNotFound, InvalidArgument) as e:
        if e.message.startswith("executable not found:"):  # the agent's words (agent.children)
            code = exits.NOT_FOUND
        elif e.message.startswith("cannot execute "):
            code = exits.CANNOT_INVOKE
        else:
            raise
        output.print_error(e)
        raise CannotRun(code) from None


def _max_output(text: str | None) -> int | None:
    """``--max-output``: a size such as 4M, within ``MAX_OUTPUT``."""
    if text is None:
        return None
    return check_max_output(byte_size(text, "--max-output", "give bytes or a size such as 512K or 4M", units="KM"))


def cmd_sh(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    sock = ws.sessions.attach()
    stdin = sys.stdin.fileno()
    is_tty = os.isatty(stdin)
    saved = termios.tcgetattr(stdin) if is_tty else None
    try:
        if is_tty:
            tty.setraw(stdin)
        stdin_open = True
        while True:
            fds = [sock] + ([stdin] if stdin_open else [])
            ready, _, _ = select.select(fds, [], [])
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    break
                os.write(sys.stdout.fileno(), data)
            if stdin_open and stdin in ready:
                data = os.read(stdin, 65536)
                if data:
                    sock.sendall(data)
                else:
                    stdin_open = False
                    sock.sendall(b"exit\n")
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        sock.close()
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    infos = filtered(Workspace.list(), args.filter)
    if args.json:
        output.print_json(infos)
        return 0
    if args.quiet:
        for i in infos:
            print(i.id)
        return 0
    rows = [
        (i.id, i.name, i.image, i.state, i.pid, i.parent,
         datetime.fromtimestamp(i.created_at).strftime("%H:%M:%S"), output.human_bytes(i.memory_limit), i.pids_limit)
        for i in infos
    ]
    output.print_table(None, ["ID", "NAME", "IMAGE", "STATE", "PID", "PARENT", "CREATED", "MEMORY", "PIDS"], rows)
    return 0


def filtered(infos: list[WorkspaceInfo], filters: list[str]) -> list[WorkspaceInfo]:
    """``ls --filter KEY=VALUE``: the workspaces matching every filter (``id`` by prefix)."""
    wanted: list[tuple[str, str]] = []
    for f in filters:
        key, sep, value = f.partition("=")
        if not sep or key not in FILTER_KEYS:
            raise InvalidArgument(f"bad --filter {f!r}", hint=f"use KEY=VALUE with KEY one of {', '.join(FILTER_KEYS)}")
        wanted.append(("state" if key == "status" else key, value))

    def match(i: WorkspaceInfo, field: str, value: str) -> bool:
        have = getattr(i, field)
        return str(have).startswith(value) if field == "id" else (have or "") == value

    return [i for i in infos if all(match(i, k, v) for k, v in wanted)]


def cmd_stats(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    st = ws.stats()
    if args.json:  # the HTTP API's keys (flat)
        output.print_json(StatsOut.of(st).model_dump(mode="json"))
        return 0
    m = st.memory
    output.print_table(
        f"workspace {st.id}",
        ["PROCESSES", "CGROUP", "PSS", "USS", "ANON"],
        [(st.processes, output.human_bytes(m.cgroup_bytes), output.human_bytes(m.pss_bytes),
          output.human_bytes(m.uss_bytes), output.human_bytes(m.anon_bytes))],
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Workspaces are removed together (``remove_all``: one kill, one wait, one store
    transaction); a batch that fails is retried one by one. Exit 125 if any failed."""
    refs = list(args.workspaces)
    if args.all:
        refs += [i.id for i in Workspace.list() if i.id not in refs]
    elif not refs:
        raise InvalidArgument("no workspace given", hint="bunshin rm WS... (or --all)")
    snaps = [r for r in refs if r.startswith("snap-")]
    if snaps:
        output.deprecated("bunshin rm snap-...", "bunshin snapshot rm " + " ".join(snaps))
    failed: list[str] = []
    found: list[tuple[str, Workspace]] = []
    for ref in (r for r in refs if not r.startswith("snap-")):
        try:
            found.append((ref, Workspace.get(ref)))
        except WorkspaceNotFound as e:
            if not args.force:
                failed.append(ref)
                output.print_error(e)
        except Exception as e:  # keep going: remove what can be removed, report the rest
            failed.append(ref)
            output.print_error(e)
    removed, failed_batch = _remove_found(found, quiet=args.json)
    failed += failed_batch
    for ref in snaps:
        try:
            Snapshot.get(ref).remove()
            removed.append(ref)
        except Exception as e:
            failed.append(ref)
            output.print_error(e)
    if args.json:
        output.print_json({"removed": removed, "failed": failed})
    elif removed:
        print("\n".join(removed))
    return exits.FAILED if failed else 0


def _remove_found(found: list[tuple[str, Workspace]], *, quiet: bool) -> tuple[list[str], list[str]]:
    """All at once, else one by one: (removed, failed)."""
    removed: list[str] = []
    failed: list[str] = []
    with output.progress(f"removing {len(found)} workspaces", quiet=quiet or len(found) < 2):
        try:
            remove_all([ws for _, ws in found])
            removed += [ref for ref, _ in found]
        except Exception:  # noqa: BLE001 (each one again, each failure reported)
            for ref, ws in found:
                try:
                    ws.remove()
                    removed.append(ref)
                except Exception as e:
                    failed.append(ref)
                    output.print_error(e)
    return removed, failed


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    """``-e KEY=VALUE`` options as a dict."""
    env = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgument(f"malformed -e {pair!r}", hint="use -e KEY=VALUE")
        env[key] = value
    return env
