"""``bunshin cluster init|up|status|reclaim|down``: one bunshin host per node of a running Ray cluster."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from .. import console as output

if TYPE_CHECKING:
    from ..cluster import Cluster


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="bunshin hosts on a Ray cluster (one `bunshin serve` per node)")
    csub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    csub.required = True
    addr_help = "the Ray cluster (default auto: the one this machine joined with `ray start`)"
    secret_help = "the cluster secret, at this path on every host (default $BUNSHIN_CLUSTER_SECRET, else " \
                  "BUNSHIN_HOME/cluster.secret)"

    init = csub.add_parser("init", help="make the cluster secret (copy it to the same path on every host)")
    init.add_argument("--secret-file", type=Path, default=None, metavar="PATH", help=secret_help)
    init.add_argument("--json", action="store_true")
    init.set_defaults(func=cmd_init)

    up = csub.add_parser("up", help="start a host actor and its bunshin serve on every node that has none")
    up.add_argument("--address", default="auto", help=addr_help)
    up.add_argument("--home-root", type=Path, default=None, metavar="DIR",
                    help="each node's home is DIR/NAME (several hosts on one machine); default: each "
                         "node's BUNSHIN_HOME")
    up.add_argument("--bind", default=None, metavar="ADDR|IFACE|ray",
                    help="where the servers listen: an address, an interface of the cluster's own network (its "
                         "address on each node), or ray (each node's Ray address); default 127.0.0.1, for a "
                         "cluster on one machine")
    up.add_argument("--secret-file", type=Path, default=None, metavar="PATH", help=secret_help)
    up.add_argument("--allow-unauthenticated-ray", action="store_true",
                    help="start on a Ray cluster without token authentication (anyone who reaches it is root "
                         "on every host)")
    up.add_argument("--max-workspaces", type=int, default=None, metavar="N", help="per host (429 past it)")
    up.add_argument("--max-memory", default=None, metavar="SIZE", help="per host: sum of memory limits, e.g. 48G")
    up.add_argument("--reserve-memory", default="auto", metavar="SIZE",
                    help="per host: memory kept free (default auto: 5%% of RAM, >= 512M; 'off')")
    up.add_argument("--json", action="store_true")
    up.set_defaults(func=cmd_up)

    st = csub.add_parser("status", help="hosts, free memory, workspaces, snapshots held, load")
    st.add_argument("--address", default="auto", help=addr_help)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    rec = csub.add_parser("reclaim", help="empty a host that came back after a crash (its work was retried "
                                           "elsewhere): workspaces and snapshots removed, gc, server restarted")
    rec.add_argument("name", help="the host's name (see status)")
    rec.add_argument("--address", default="auto", help=addr_help)
    rec.add_argument("--json", action="store_true")
    rec.set_defaults(func=cmd_reclaim)

    down = csub.add_parser("down", help="stop every host's server and actor (workspaces stay for the next up)")
    down.add_argument("--address", default="auto", help=addr_help)
    down.add_argument("--json", action="store_true")
    down.set_defaults(func=cmd_down)


def cmd_up(args: argparse.Namespace) -> int:
    from ..cluster import Cluster, HostLimits
    from ..runtime.container.cgroups import parse_size
    from .serve_cmds import _reserve

    limits = HostLimits(max_workspaces=args.max_workspaces, max_memory=parse_size(args.max_memory),
                        reserve_memory=_reserve(args.reserve_memory))
    cluster = Cluster.up(address=args.address, home_root=args.home_root, bind=args.bind, limits=limits,
                         secret_file=args.secret_file, allow_unauthenticated_ray=args.allow_unauthenticated_ray)
    return _print_status(cluster, args.json)


def cmd_init(args: argparse.Namespace) -> int:
    from ..cluster.secret import ClusterSecret

    secret = ClusterSecret.create(args.secret_file)
    if args.json:
        output.print_json({"secret_file": str(secret.path)})
    else:
        print(f"made the cluster secret {secret.path} (mode 0600): copy it to the same path on every host "
              "(scp, your secrets manager), then `bunshin cluster up` on the head")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from ..cluster import Cluster

    return _print_status(Cluster.connect(args.address), args.json)


def cmd_reclaim(args: argparse.Namespace) -> int:
    from ..cluster import Cluster

    removed = Cluster.connect(args.address).reclaim(args.name)
    if args.json:
        output.print_json({"host": args.name, "removed": removed})
    else:
        print(f"{args.name}: removed {removed['workspaces']} workspace(s), {removed['snapshots']} snapshot(s), "
              f"gc {removed['gc']}; serving again")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ..cluster import Cluster

    stopped = Cluster.connect(args.address).down()
    if args.json:
        output.print_json({"stopped": stopped})
    else:
        print(f"stopped {len(stopped)} host(s): {', '.join(stopped) or '-'}")
    return 0


def _print_status(cluster: Cluster, as_json: bool) -> int:
    hosts = cluster.status()
    if as_json:
        output.print_json({"hosts": [h.to_dict() for h in hosts]})
    else:
        output.print_table("bunshin cluster", ["host", "url", "alive", "free memory", "workspaces", "snapshots",
                                               "load", "max workspaces", "unsigned records"],
                           [[h.name, h.url or "-", "yes" if h.alive else f"no: {h.error}",
                             output.human_bytes(h.free_memory), h.workspaces, len(h.snapshots), f"{h.load:.2f}",
                             h.limits.max_workspaces or "-", h.rejected] for h in hosts])
    return 0 if hosts and all(h.alive for h in hosts) else 1


def register_bench(bsub: argparse._SubParsersAction) -> None:
    """``bunshin bench cluster`` (registered under ``bench`` by system_cmds)."""
    b = bsub.add_parser("cluster", help="the quick rollout workload on 1, 2 and 4 simulated hosts (local Ray)")
    b.add_argument("--hosts", default="1,2,4", help="cluster sizes, comma-separated (default 1,2,4)")
    b.add_argument("--workload", default="coding-lite", help="coding-lite (default), data-analysis or coding")
    b.add_argument("--tasks", type=int, default=2, help="tasks (default 2), one group each, all at once")
    b.add_argument("--group", type=int, default=8, help="trajectories per task (default 8)")
    b.add_argument("--think-scale", type=float, default=0.5, help="multiply recorded think times (default 0.5)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_cluster, release_tmpfs=True)


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from ..bench import cluster as bench_cluster
    from ..config import Config
    from ..errors import InvalidArgument

    try:
        hosts = tuple(int(x) for x in args.hosts.split(","))
    except ValueError:
        raise InvalidArgument(f"--hosts {args.hosts!r}", hint="give sizes like 1,2,4") from None
    plan = bench_cluster.Plan(hosts=hosts, workload=args.workload, tasks=args.tasks, group=args.group,
                              think_scale=args.think_scale)
    r = bench_cluster.run(Config.from_env(), plan)
    if args.json:
        output.print_json(r)
    else:
        bench_cluster.print_report(r)
    return 0 if all(s["failed"] == 0 and s["same_rewards_as_first"] for s in r["sizes"]) else 1
