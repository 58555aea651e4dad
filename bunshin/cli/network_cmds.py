"""CLI of a workspace's network: ports in (``create -p``, ``bunshin port``).

``-p/--publish`` takes docker's forms: ``PORT``, ``HOST_PORT:PORT``,
``HOST:HOST_PORT:PORT`` (loopback unless HOST says otherwise; no HOST_PORT: a free one).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import console as output
from ..runtime.container.publish import Published, parse
from ..workspace import Workspace

PUBLISH_HELP = ("publish a port of the workspace on the host: PORT, HOST_PORT:PORT or HOST:HOST_PORT:PORT "
                "(loopback unless HOST says otherwise; a free host port if none is given); repeatable")


def add_create_args(p: argparse.ArgumentParser) -> None:
    """``create``'s network options."""
    p.add_argument("-p", "--publish", action="append", default=[], metavar="[[HOST:]HOST_PORT:]PORT",
                   help=PUBLISH_HELP)


def publish_all(ws: Workspace, specs: Sequence[str]) -> list[Published]:
    """Publish every ``-p`` of a new workspace; checked all first, so a bad one publishes none."""
    wanted = [parse(s) for s in specs]
    return [ws.publish(port, host_port, host) for port, host_port, host in wanted]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("port", help="list, add or remove a workspace's published ports (like `docker port`)")
    p.add_argument("workspace")
    p.add_argument("-p", "--publish", action="append", default=[], metavar="[[HOST:]HOST_PORT:]PORT",
                   help=PUBLISH_HELP)
    p.add_argument("--rm", action="append", default=[], type=int, metavar="HOST_PORT",
                   help="stop publishing this host port; repeatable")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_port)


def cmd_port(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    for host_port in args.rm:
        ws.unpublish(host_port)
    publish_all(ws, args.publish)
    ports = ws.published()
    if args.json:
        output.print_json([{"port": p.port, "host": p.host, "host_port": p.host_port} for p in ports])
    else:
        for p in ports:
            print(f"{p.port}/tcp -> {p.address}")
    return 0
