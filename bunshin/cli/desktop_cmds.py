"""CLI commands on a workspace's desktop: screenshot, windows, launch, osworld, vnc."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from .. import console as output
from ..errors import InvalidArgument, StateConflict
from ..workspace import Workspace
from ..workspace.desktop import OSWORLD_PORT, Desktop, forward_command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("desktop", help="the desktop of a workspace made with `create --desktop`")
    dsub = p.add_subparsers(dest="desktop_command", metavar="ACTION")
    dsub.required = True

    s = dsub.add_parser("screenshot", help="save the screen as a PNG")
    s.add_argument("workspace")
    s.add_argument("-o", "--output", default="screen.png", help="the PNG file to write (default screen.png)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_screenshot)

    s = dsub.add_parser("windows", help="the app windows on the screen")
    s.add_argument("workspace")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_windows)

    s = dsub.add_parser("launch", help="start an app on the desktop: bunshin desktop launch WS -- xterm")
    s.add_argument("workspace")
    s.add_argument("--json", action="store_true")
    s.add_argument("cmd", nargs="*", help="-- APP [ARGS...]")
    s.set_defaults(func=cmd_launch)

    s = dsub.add_parser("osworld", help="start OSWorld's VM server (:5000 on the workspace's loopback) and print "
                                        "how to reach it")
    s.add_argument("workspace")
    s.add_argument("--port", type=int, default=5000, help="the host loopback port to suggest (default 5000)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_osworld)

    s = dsub.add_parser("vnc", help="start x11vnc on the workspace's loopback and print how to watch it")
    s.add_argument("workspace")
    s.add_argument("--port", type=int, default=5901, help="the host loopback port to suggest (default 5901)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_vnc)


def cmd_screenshot(args: argparse.Namespace) -> int:
    desk = Desktop.of(Workspace.get(args.workspace))
    png = desk.screenshot()
    out = Path(args.output)
    out.write_bytes(png)
    if args.json:
        output.print_json({"path": str(out.resolve()), "bytes": len(png), "width": desk.spec.width,
                           "height": desk.spec.height})
    else:
        print(out)
    return 0


def cmd_windows(args: argparse.Namespace) -> int:
    names = Desktop.of(Workspace.get(args.workspace)).windows()
    if args.json:
        output.print_json({"windows": names})
    else:
        for n in names:
            print(n)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    if not args.cmd:
        raise InvalidArgument("no app given", hint="bunshin desktop launch WS -- xterm")
    pid = Desktop.of(Workspace.get(args.workspace)).launch(args.cmd)
    if args.json:
        output.print_json({"pid": pid})
    else:
        print(pid)
    return 0


def cmd_vnc(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    desk = Desktop.of(ws)
    running = ws.exec(["sh", "-c", "pgrep -x x11vnc"]).exit_code == 0
    if not running:
        desk.start_vnc()
    if ws.record.pid is None:
        raise StateConflict(f"workspace {ws.id} has no running init", hint="it is not running; create a new one")
    forward = " ".join(shlex.quote(a) for a in forward_command(ws.record.pid, desk.spec.vnc_port, args.port))
    if args.json:
        output.print_json({"workspace": ws.id, "vnc_port": desk.spec.vnc_port, "started": not running,
                           "forward": forward, "viewer": f"vncviewer 127.0.0.1:{args.port}"})
    else:
        print(f"x11vnc listens on 127.0.0.1:{desk.spec.vnc_port} inside {ws.id} (its own loopback only).")
        print("To watch from this host, run:")
        print(f"  {forward}")
        print(f"  vncviewer 127.0.0.1:{args.port}")
    return 0


def cmd_osworld(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    desk = Desktop.of(ws)
    running = ws.exec(["pgrep", "-f", "[b]unshin_agent.osworld"]).exit_code == 0
    if not running:
        desk.start_osworld()
    if ws.record.pid is None:
        raise StateConflict(f"workspace {ws.id} has no running init", hint="it is not running; create a new one")
    forward = " ".join(shlex.quote(a) for a in forward_command(ws.record.pid, OSWORLD_PORT, args.port))
    if args.json:
        output.print_json({"workspace": ws.id, "port": OSWORLD_PORT, "started": not running, "forward": forward,
                           "url": f"http://127.0.0.1:{args.port}"})
    else:
        print(f"OSWorld's server listens on 127.0.0.1:{OSWORLD_PORT} inside {ws.id}. To reach it from this host:")
        print(f"  {forward}")
        print(f"  then point OSWorld's controllers at http://127.0.0.1:{args.port}")
    return 0
