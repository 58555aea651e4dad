"""CLI commands on the host: doctor, gc, bench, demo."""

from __future__ import annotations

import argparse

from .. import console as output
from ..config import Config
from ..runtime import doctor, gc
from ..runtime.store import Store


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check that this host can run workspaces")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("gc", help="remove everything no live workspace owns (after a crash)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    b = bsub.add_parser("runtime", help="create latency, exec round trip, idle memory")
    b.add_argument("-n", type=int, default=20, help="workspaces (default 20)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_runtime)

    p = sub.add_parser("demo", help="the main job: create a workspace, use it, show its stats, remove it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks(Config.from_env())
    fatal = any(c.required and not c.ok for c in checks)
    if args.json:
        output.print_json({"ok": not fatal, "checks": checks})
    else:
        rows = [(("ok" if c.ok else ("FAIL" if c.required else "warn")), c.name, c.detail, c.fix or "") for c in checks]
        output.print_table("bunshin doctor", ["", "CHECK", "DETAIL", "FIX"], rows)
    return 1 if fatal else 0


def cmd_gc(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    with Store.open(cfg.db_path) as store:
        report = gc.collect(cfg, store)
    if args.json:
        output.print_json(report)
    else:
        for kind in ("workspaces", "mounts", "cgroups", "processes", "files"):
            for item in getattr(report, kind):
                print(f"removed {kind[:-1]} {item}")
        print(f"gc: {report.total} removed")
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from ..bench import runtime as bench_runtime

    result = bench_runtime.run(Config.from_env(), n=args.n)
    if args.json:
        output.print_json(result)
    else:
        bench_runtime.print_report(result)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ..bench import demo

    return demo.run(Config.from_env(), as_json=args.json)
