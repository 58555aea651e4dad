"""CLI of a workspace's network: egress (``create --network``, ``bunshin network``) and
ports in (``create -p``, ``bunshin port``).

``--allow``/``--deny`` take CIDRs, addresses, domain names and ``*.domain`` wildcards
(repeatable); ``bunshin network set`` replaces a running workspace's whole policy.

``-p/--publish`` takes docker's forms: ``PORT``, ``HOST_PORT:PORT``,
``HOST:HOST_PORT:PORT`` (loopback unless HOST says otherwise; no HOST_PORT: a free one).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from .. import console as output
from ..errors import InvalidArgument
from ..runtime.container.publish import Published, parse
from ..runtime.net.policy import NetworkMode, Policy
from ..workspace import Workspace

PUBLISH_HELP = ("publish a port of the workspace on the host: PORT, HOST_PORT:PORT or HOST:HOST_PORT:PORT "
                "(loopback unless HOST says otherwise; a free host port if none is given); repeatable")


RULE_HELP = "a CIDR, an address, a domain name or *.domain; repeatable"


def add_create_args(p: argparse.ArgumentParser) -> None:
    """``create``'s network options."""
    p.add_argument("--network", choices=[m.value for m in NetworkMode], default=NetworkMode.NONE.value,
                   help="none: loopback only (default); egress: an address and NAT out, under --allow/--deny")
    p.add_argument("--allow", action="append", default=[], metavar="RULE",
                   help=f"with --network egress: let only what is allowed out ({RULE_HELP})")
    p.add_argument("--deny", action="append", default=[], metavar="RULE", help=f"with --network egress: refuse ({RULE_HELP})")
    p.add_argument("-p", "--publish", action="append", default=[], metavar="[[HOST:]HOST_PORT:]PORT",
                   help=PUBLISH_HELP)


def publish_all(ws: Workspace, specs: Sequence[str]) -> list[Published]:
    """Publish every ``-p`` of a new workspace; checked all first, so a bad one publishes none."""
    wanted = [parse(s) for s in specs]
    return [ws.publish(port, host_port, host) for port, host_port, host in wanted]


def network_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``create``'s network options as ``Workspace.create`` arguments, checked first."""
    if (args.allow or args.deny) and args.network != NetworkMode.EGRESS:
        raise InvalidArgument("--allow and --deny need --network egress",
                              hint="bunshin create --network egress --allow pypi.org ...")
    Policy.of(args.allow, args.deny)  # a bad rule before anything is made
    return {"network": args.network, "allow": args.allow, "deny": args.deny}


def policy_out(ws: Workspace) -> dict[str, Any]:
    policy = ws.network_policy()
    if policy is None:
        return {"id": ws.id, "network": NetworkMode.NONE.value, "address": None, "allow": [], "deny": []}
    return {"id": ws.id, "network": NetworkMode.EGRESS.value, "address": ws.network_address(),
            "allow": [*policy.allow_cidrs, *policy.allow_names], "deny": [*policy.deny_cidrs, *policy.deny_names],
            "limits": dataclasses.asdict(policy.limits)}


def register(sub: argparse._SubParsersAction) -> None:
    net = sub.add_parser("network", help="a workspace's egress: show it, or replace its policy")
    nsub = net.add_subparsers(dest="network_command", metavar="COMMAND")
    nsub.required = True
    p = nsub.add_parser("show", help="a workspace's network mode, address and policy")
    p.add_argument("workspace")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_network_show)
    p = nsub.add_parser("set", help="replace a running workspace's policy (its clones keep theirs)")
    p.add_argument("workspace")
    p.add_argument("--allow", action="append", default=[], metavar="RULE", help=f"let only what is allowed out ({RULE_HELP})")
    p.add_argument("--deny", action="append", default=[], metavar="RULE", help=f"refuse ({RULE_HELP})")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_network_set)

    p = sub.add_parser("port", help="list, add or remove a workspace's published ports (like `docker port`)")
    p.add_argument("workspace")
    p.add_argument("-p", "--publish", action="append", default=[], metavar="[[HOST:]HOST_PORT:]PORT",
                   help=PUBLISH_HELP)
    p.add_argument("--rm", action="append", default=[], type=int, metavar="HOST_PORT",
                   help="stop publishing this host port; repeatable")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_port)


def _print_policy(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        output.print_json(out)
        return
    print(f"network: {out['network']}" + (f" ({out['address']})" if out["address"] else ""))
    for key in ("allow", "deny"):
        if out[key]:
            print(f"{key}: {' '.join(out[key])}")


def cmd_network_show(args: argparse.Namespace) -> int:
    _print_policy(policy_out(Workspace.get(args.workspace)), args.json)
    return 0


def cmd_network_set(args: argparse.Namespace) -> int:
    ws = Workspace.get(args.workspace)
    ws.set_network_policy(args.allow, args.deny)
    _print_policy(policy_out(ws), args.json)
    return 0


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
