"""CLI commands on the host: doctor, gc, bench, demo."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..runtime.state.store import Store
from ..runtime.upkeep import doctor, gc


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
    dev = bsub.add_parser("dev", help="developer benchmarks: the costs of single mechanisms (CRIU phases, the "
                                      "SIGSYS trap, memory-file copies, read bounds)").add_subparsers(
        dest="dev_bench", metavar="BENCH")
    dev.required = True
    b = bsub.add_parser("runtime", help="create latency, exec round trip, idle memory")
    b.add_argument("-n", type=int, default=20, help="workspaces (default 20)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_runtime, release_tmpfs=True)
    b = bsub.add_parser("cache", help="tool prefix cache and speculation on a real coding task")
    b.add_argument("--quick", action="store_true", help="2 iterations, shorter think times (a few minutes)")
    b.add_argument("--group", type=int, default=8, help="trajectories per group (default 8)")
    b.add_argument("--iterations", type=int, default=None, help="training iterations (default 3, quick 2)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_cache, release_tmpfs=True)
    b = bsub.add_parser("fork", help="live fork vs plain CRIU restore vs cold start: latency and memory")
    b.add_argument("--sizes", default=None, help="clone counts, comma-separated (default 1,8,32,64)")
    b.add_argument("--heap-mib", type=int, default=None, help="heap of the forked process (default 256)")
    b.add_argument("--depth", type=int, default=8, help="forks of forks down to this depth (default 8)")
    b.add_argument("--quick", action="store_true", help="CI-sized: sizes 1,8, heap 64 MiB, 2 cold starts")
    b.add_argument("--mode", choices=("both", "cow", "copy", "trap", "precopy"), default="both",
                   help="bunshin's copy-on-write fork, plain CRIU (copy), or both side by side (default); "
                        "trap: the copy-on-write fork with and without the SIGSYS trap of converted memory; "
                        "precopy: fresh workspaces forked with and without live pre-copy (Config.fork_precopy)")
    b.add_argument("--cold", type=int, default=None, help="cold starts to time (default 3, quick 2; 0: none)")
    b.add_argument("--report", metavar="DIR", help="also write a markdown report, results.json and fork.png here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_fork, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "trap", "what one call the SIGSYS trap of converted memory intercepts costs"):
        b.add_argument("--rounds", type=int, default=5, help="timing rounds, clone and parent alternately (default 5)")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_trap, release_tmpfs=True)
    b = bsub.add_parser("desktop", help="a desktop with an app open: fork vs plain CRIU vs cold start, and a "
                                        "computer-use rollout group (baseline vs bunshin)")
    b.add_argument("--app", default="gnumeric", help="the app open on the desktop: gnumeric (default), mousepad, xedit")
    b.add_argument("--clones", type=int, default=16, help="clones per side (default 16)")
    b.add_argument("--cold", type=int, default=3, help="cold starts (default 3)")
    b.add_argument("--group", type=int, default=8, help="trajectories of the rollout group (default 8)")
    b.add_argument("--no-rollout", action="store_true", help="skip the rollout group")
    b.add_argument("--report", metavar="DIR", help="write report.md, results.json and the screens (PNG) here")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_desktop, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "clone-memory", "what a clone owns after its first exec and tool call, per process"):
        b.add_argument("--clones", type=int, default=3, help="clones measured one after another (default 3)")
        b.add_argument("--calls", default="thread,fork",
                       help="how the agent serves calls, one run each, side by side (default thread,fork)")
        b.add_argument("--rounds", type=int, default=20, help="exec and tool calls timed per clone after it is measured (default 20)")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_clone_memory, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "delta-pause", "forks of a running fork: the parent's pause per CRIU phase"):
        b.add_argument("--forks", type=int, default=8, help="delta forks taken one after another (default 8)")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_delta_pause, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "restore-phases", "clones restored: each restore's time per CRIU phase and step"):
        b.add_argument("--clones", type=int, default=64, help="clones restored, in batches of 32 (default 64)")
        b.add_argument("--heap-mib", type=int, default=64, help="heap of the forked process (default 64)")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_restore_phases, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "memfile-copy", "dumped pages into memory files: write_data against the kernel's copies, GB/s"):
        b.add_argument("--mib", type=int, default=1024, help="bytes to copy, MiB (default 1024)")
        b.add_argument("--rounds", type=int, default=3, help="copies per method, alternated (default 3)")
        b.add_argument("--zero-share", type=float, default=0.0, help="share of zero pages in the source (default 0)")
        b.add_argument("--methods", default=None,
                       help="comma-separated (default all): write_data_huge,write_data,copy_file_range,pread_pwrite")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_memfile_copy, release_tmpfs=True)

    b = bsub.add_parser("image", help="OCI images against the host image: pull+unpack, storage, create, fork")
    b.add_argument("--clones", type=int, default=64, help="clones per fork (default 64)")
    b.add_argument("--heap-mib", type=int, default=64, help="the forked workspace's heap (default 64)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_image, release_tmpfs=True)

    b = bsub.add_parser("network", help="egress and ports in: fork/restore cost off and on, throughput, N clones "
                                        "fetching at once, pasta against veth + nftables")
    b.add_argument("--quick", action="store_true", help="3 rounds, 64 MiB, 8 clones (default: 10, 256 MiB, 64)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_network, release_tmpfs=True)

    b = bsub.add_parser("serve", help="the HTTP API against in-process calls: latency, exec throughput")
    b.add_argument("--rounds", type=int, default=30, help="calls per kind (default 30)")
    b.add_argument("--forks", type=int, default=8, help="forks per side (default 8)")
    b.add_argument("--seconds", type=float, default=5.0, help="per throughput row (default 5)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_serve, release_tmpfs=True)
    for b in dev_bench(bsub, dev, "read-bounds", "a big sparse file read through the server by every path: what each "
                                            "costs the server's memory"):
        b.add_argument("--mib", type=int, default=600, help="the sparse file's size (default 600)")
        b.add_argument("--json", action="store_true")
        b.set_defaults(func=cmd_bench_read_bounds, release_tmpfs=True)

    b = bsub.add_parser("adapters", help="a framework's group on the coding task, with and without the group fork")
    b.add_argument("--framework", default="miniswe", help="miniswe (default) or skyrl")
    b.add_argument("--group", type=int, default=8, help="runs of one task (default 8)")
    b.add_argument("--think-scale", type=float, default=0.5, help="multiply recorded think times (default 0.5)")
    b.add_argument("--workload", default="coding", help="coding (default) or coding-lite")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench_adapters, release_tmpfs=True)

    b = bsub.add_parser("rollout", help="rollouts in every mode side by side: memory, latency, rewards "
                        "(full: ~30 min; --quick: ~4 min)")
    b.add_argument("--quick", action="store_true", help="groups of 8 only, 2 tasks per workload, shorter think times")
    b.add_argument("--json", action="store_true")
    b.add_argument("--report", metavar="DIR", help="write a markdown report and PNG plots here")
    b.add_argument("--modes", help="comma-separated: baseline,copy,bunshin[,bunshin:no-spec,bunshin:no-cache,bunshin:no-fork]")
    b.add_argument("--workloads", help="comma-separated: data-analysis,coding (coding-lite: no download)")
    b.add_argument("--think-scale", type=float, help="multiply recorded think times (default 1, quick 0.5)")
    b.add_argument("--groups", help="comma-separated group sizes (default 8,32; quick 8)")
    b.add_argument("--tasks", type=int, help="tasks per workload (default 3; quick 2)")
    b.set_defaults(func=cmd_bench_rollout, release_tmpfs=True)

    from .cluster_cmds import register_bench as register_bench_cluster
    from .e2b_cmds import register_bench as register_bench_e2b

    register_bench_cluster(bsub)
    register_bench_e2b(bsub)

    p = sub.add_parser("demo", help="the main job: rollouts in baseline, copy and bunshin mode, side by side")
    p.add_argument("--json", action="store_true")
    p.add_argument("--report", metavar="DIR", help="also write a markdown report and PNG plots here")
    p.set_defaults(func=cmd_demo, release_tmpfs=True)


def dev_bench(bsub: argparse._SubParsersAction, dev: argparse._SubParsersAction, name: str,
              help_text: str) -> tuple[argparse.ArgumentParser, ...]:
    """A developer benchmark: ``bench dev NAME`` (listed) and ``bench NAME`` (its old
    name, kept working but not listed: scripts and tests call it)."""
    return (dev.add_parser(name, help=help_text, description=help_text),
            bsub.add_parser(name, description=help_text))


def _report(args: argparse.Namespace, result: dict[str, Any], print_report: Callable[[dict[str, Any]], None]) -> int:
    """A bench's result: JSON with ``--json``, else its report; exit 0."""
    if args.json:
        output.print_json(result)
    else:
        print_report(result)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks(Config.from_env())
    fatal = any(c.required and not c.ok for c in checks)
    if args.json:
        output.print_json({"ok": not fatal, "checks": checks})
    else:
        rows = [(("ok" if c.ok else ("FAIL" if c.required else "warn")), c.name, c.detail, c.fix or "") for c in checks]
        output.print_table("bunshin doctor", ["", "CHECK", "DETAIL", "FIX"], rows)
    return 1 if fatal else 0


def cmd_bench_image(args: argparse.Namespace) -> int:
    from ..bench import image as bench_image

    r = bench_image.run(Config.from_env(), clones=args.clones, heap_mib=args.heap_mib)
    return _report(args, r, bench_image.print_report)


def cmd_bench_clone_memory(args: argparse.Namespace) -> int:
    from ..bench import clone_memory

    r = clone_memory.run_calls(Config.from_env(), clones=args.clones, calls=args.calls.split(","), rounds=args.rounds)
    if args.json:
        output.print_json(r)
    else:
        for one in r["by_calls"].values():
            clone_memory.print_report(one)
    return 0


def cmd_bench_delta_pause(args: argparse.Namespace) -> int:
    from ..bench import dump_phases

    r = dump_phases.run(Config.from_env(), forks=args.forks)
    return _report(args, r, dump_phases.print_report)


def cmd_bench_restore_phases(args: argparse.Namespace) -> int:
    from ..bench import restore_phases

    r = restore_phases.run(Config.from_env(), clones=args.clones, heap_mib=args.heap_mib)
    return _report(args, r, restore_phases.print_report)


def cmd_bench_memfile_copy(args: argparse.Namespace) -> int:
    from ..bench import memfile_copy

    methods = tuple(args.methods.split(",")) if args.methods else tuple(memfile_copy.METHODS)
    r = memfile_copy.run(Config.from_env(), mib=args.mib, rounds=args.rounds, zero_share=args.zero_share,
                         methods=methods)
    return _report(args, r, memfile_copy.print_report)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from ..bench import serve as bench_serve

    r = bench_serve.run(Config.from_env(), rounds=args.rounds, forks=args.forks, seconds=args.seconds)
    return _report(args, r, bench_serve.print_report)


def cmd_bench_network(args: argparse.Namespace) -> int:
    from ..bench import network as bench_network

    r = bench_network.run(Config.from_env(), quick=args.quick)
    return _report(args, r, bench_network.print_report)


def cmd_bench_read_bounds(args: argparse.Namespace) -> int:
    from ..bench import read_bounds

    r = read_bounds.run(Config.from_env(), mib=args.mib)
    return _report(args, r, read_bounds.print_report)


def cmd_gc(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    with output.progress("collecting what no live workspace owns", quiet=args.json), Store.open(cfg.db_path) as store:
        report = gc.collect(cfg, store, release=True)
    if args.json:
        output.print_json(report)
    else:
        for kind in ("workspaces", "snapshots", "mounts", "cgroups", "processes", "files", "image_layers"):
            for item in getattr(report, kind):
                print(f"removed {kind[:-1]} {item}")
        for item in report.network:  # a workspace link (veth) or nftables table no slot holds
            print(f"removed network {item}")
        print(f"gc: {report.total} removed")
    return 0


def cmd_bench_runtime(args: argparse.Namespace) -> int:
    from ..bench import runtime as bench_runtime

    result = bench_runtime.run(Config.from_env(), n=args.n)
    return _report(args, result, bench_runtime.print_report)


def cmd_bench_fork(args: argparse.Namespace) -> int:
    from ..bench import fork as bench_fork
    from ..bench import fork_report
    from ..errors import InvalidArgument

    default_sizes, heap, cold = ("1,8", 64, 2) if args.quick else ("1,8,32,64", 256, 3)
    try:
        sizes = tuple(int(s) for s in (args.sizes or default_sizes).split(","))
    except ValueError:
        raise InvalidArgument(f"malformed --sizes {args.sizes!r}", hint="e.g. --sizes 1,8,32") from None
    if args.mode == "precopy":
        from ..bench import fork_precopy

        result = fork_precopy.run(Config.from_env(), heap_mib=args.heap_mib or heap, sizes=sizes)
        if args.json:
            output.print_json(result)
        else:
            output.print_table(*fork_precopy.phase_table(result))
        return 0
    modes = {"both": ("cow", "copy"), "trap": ("cow", bench_fork.UNTRAPPED)}.get(args.mode, (args.mode,))
    result = bench_fork.run(Config.from_env(), sizes=sizes, heap_mib=args.heap_mib or heap,
                            cold=cold if args.cold is None else args.cold, depth=args.depth, modes=modes)
    if args.report:
        fork_report.write(result, args.report)
    return _report(args, result, fork_report.print_report)


def cmd_bench_trap(args: argparse.Namespace) -> int:
    from ..bench import trap_cost

    result = trap_cost.run(Config.from_env(), rounds=args.rounds)
    if args.json:
        output.print_json(result)
    else:
        sides = ("parent", "clone", "trap_overhead_ns")
        output.print_table("ns per call (median of the rounds)", ["", *trap_cost.KEYS],
                           [[side, *(result[side][k] for k in trap_cost.KEYS)] for side in sides])
    return 0


def cmd_bench_desktop(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..bench import desktop as bench_desktop

    plan = bench_desktop.DesktopPlan(app=args.app, clones=args.clones, cold=args.cold, group=args.group,
                                     rollout=not args.no_rollout)
    say = (lambda _m: None) if args.json else (lambda m: output.err.print(f"[dim]{m}[/dim]"))
    result = bench_desktop.run(Config.from_env(), plan, out=Path(args.report) if args.report else None, say=say)
    return _report(args, result, bench_desktop.print_report)


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from ..bench import rollout as bench_rollout

    def split(v: str | None) -> tuple[str, ...] | None:
        return tuple(x.strip() for x in v.split(",") if x.strip()) if v else None

    try:
        plan = bench_rollout.Plan.make(quick=args.quick, modes=split(args.modes), workloads=split(args.workloads),
                                       think_scale=args.think_scale, tasks=args.tasks,
                                       group_sizes=tuple(int(g) for g in split(args.groups) or ()) or None)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    result = bench_rollout.run(Config.from_env(), plan)
    if args.report:
        from ..bench import rollout_report

        rollout_report.write(result, args.report)
        output.err.print(f"report written to {args.report}/report.md")
    return _report(args, result, bench_rollout.print_report)


def cmd_bench_adapters(args: argparse.Namespace) -> int:
    from ..bench import adapters as bench_adapters

    result = bench_adapters.run(Config.from_env(), framework=args.framework, group=args.group,
                                think_scale=args.think_scale, workload=args.workload)
    return _report(args, result, bench_adapters.print_report)


def cmd_bench_cache(args: argparse.Namespace) -> int:
    from ..bench import cache as bench_cache

    result = bench_cache.run(Config.from_env(), quick=args.quick, group=args.group, iterations=args.iterations)
    if args.json:
        output.print_json(result)
    else:
        bench_cache.print_report(result)
    return 0 if result["correct"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    from ..bench import demo

    return demo.run(Config.from_env(), as_json=args.json, report=args.report)
