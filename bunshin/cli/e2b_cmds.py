"""``bunshin bench e2b``: the unmodified e2b SDK on ``bunshin serve`` against bunshin's own calls."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import console as output


def register_bench(bsub: argparse._SubParsersAction) -> None:
    b = bsub.add_parser("e2b", help="the e2b SDK on bunshin serve against bunshin's own calls: create "
                                    "(template restore vs cold), fork 1/8/32, commands.run, run_code, "
                                    "sandboxes at once")
    b.add_argument("--quick", action="store_true", help="10 rounds, forks of 1 and 8, 8 sandboxes at once (~1 min)")
    b.add_argument("--rounds", type=int, default=None, help="calls timed per kind (default 30, quick 10)")
    b.add_argument("--concurrent", type=int, default=None, help="sandboxes running commands at once (default 32)")
    b.add_argument("--report", metavar="DIR", help="also write e2b.png (the p50s side by side) here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_e2b, release_tmpfs=True)


def cmd_bench_e2b(args: argparse.Namespace) -> int:
    import dataclasses

    from ..bench import e2b as bench_e2b
    from ..config import Config
    from ..errors import InvalidArgument

    plan = bench_e2b.Plan.quick() if args.quick else bench_e2b.Plan()
    for name in ("rounds", "concurrent"):
        value = getattr(args, name)
        if value is not None:
            if value < 1 or (name == "concurrent" and value < 2):
                raise InvalidArgument(f"--{name} {value} is too small", hint="at least 1 round and 2 sandboxes")
            plan = dataclasses.replace(plan, **{name: value})
    r = bench_e2b.run(Config.from_env(), plan)
    if args.report:
        r["plot"] = str(bench_e2b.plot(r, Path(args.report) / "e2b.png"))
    if args.json:
        output.print_json(r)
    else:
        bench_e2b.print_report(r)
    failed = sum(f["failed"] for f in r["fork_ms"]) + r["concurrent"]["e2b_commands_run"]["errors"]
    return 0 if failed == 0 else 1
