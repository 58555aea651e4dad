"""``bunshin rollout``: run groups of trajectories of tasks, write them as JSONL."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument

POLICY_HELP = """policy: a traces file (`traces.jsonl` or `trace:FILE`: replay with recorded think times),
`openai` (an OpenAI-compatible endpoint: --base-url, --model; key from $OPENAI_API_KEY),
or `py:MODULE:FUNCTION` (a Python callable taking a PolicyContext)"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rollout", help="run N trajectories per task, each in its own workspace",
                       description="Run a group of N trajectories per task and write them as JSONL.",
                       epilog=POLICY_HELP)
    p.add_argument("tasks", nargs="+", metavar="TASK", help="task spec files (YAML or JSON)")
    p.add_argument("--policy", required=True, help="traces.jsonl | trace:FILE | openai | py:MODULE:FUNCTION")
    p.add_argument("--group", "-n", type=int, default=8, help="trajectories per task (default 8)")
    p.add_argument("--mode", choices=["bunshin", "baseline", "copy"], default="bunshin")
    p.add_argument("--out", "-o", help="write one JSON row per trajectory here (JSONL)")
    p.add_argument("--concurrency", type=int, help="trajectories in flight at once (default: all)")
    for flag in ("cache", "speculation", "fork"):
        p.add_argument(f"--{flag}", choices=["on", "off"], default="on", help=f"bunshin mode: {flag} (default on)")
    p.add_argument("--think-scale", type=float, default=1.0, help="trace replay: multiply think times")
    p.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--model", default=os.environ.get("OPENAI_MODEL", ""))
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--server", metavar="URL", default=None,
                   help="make the workspaces on this `bunshin serve` host (token: --token-file or "
                        "BUNSHIN_TOKEN) instead of this machine; the engine, cache and policy run here")
    p.add_argument("--token-file", type=Path, default=None, help="the --server host's API token file")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=cmd_rollout, release_tmpfs=True)


def make_policy(args: argparse.Namespace) -> Any:
    from ..rollout import CallablePolicy, OpenAIPolicy, TraceReplayPolicy

    spec: str = args.policy
    if spec == "openai":
        if not args.model:
            raise InvalidArgument("--policy openai needs --model", hint="or set OPENAI_MODEL")
        return OpenAIPolicy(args.base_url, args.model, api_key=os.environ.get("OPENAI_API_KEY"),
                            temperature=args.temperature, max_tokens=args.max_tokens, timeout=args.request_timeout)
    if spec.startswith("py:"):
        mod, _, fn = spec[3:].rpartition(":")
        if not mod or not fn:
            raise InvalidArgument(f"bad --policy {spec!r}", hint="py:MODULE:FUNCTION")
        sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise InvalidArgument(f"--policy {spec}: {e}") from None
        return CallablePolicy(func)
    path = spec[6:] if spec.startswith("trace:") else spec
    if not Path(path).exists():
        raise InvalidArgument(f"--policy {spec!r}: no such file", hint=POLICY_HELP.replace("\n", " "))
    return TraceReplayPolicy.from_file(path, think_scale=args.think_scale)


async def _run(args: argparse.Namespace, tasks: list, policy: Any, on_event: Any) -> list:
    from ..rollout import ModeOptions, RolloutEngine

    options = ModeOptions(fork=args.fork == "on", cache=args.cache == "on", speculation=args.speculation == "on")
    host = None
    if args.server:
        from ..client import Client

        host = Client(args.server, token_file=args.token_file)
    try:
        async with RolloutEngine(args.mode, options=options, concurrency=args.concurrency,
                                 config=Config.from_env(), on_event=on_event, host=host) as engine:
            return await engine.run(tasks, policy, args.group)
    finally:
        if hasattr(policy, "aclose"):
            await policy.aclose()
        if host is not None:
            host.close()


def cmd_rollout(args: argparse.Namespace) -> int:
    from ..rollout import load_task
    from ..rollout.progress import GroupProgress

    tasks = [load_task(t) for t in args.tasks]
    policy = make_policy(args)
    with GroupProgress(args.mode) as progress:
        groups = asyncio.run(_run(args, tasks, policy, progress))
    if args.out:
        with open(args.out, "w") as f:
            for g in groups:
                for t in g.trajectories:
                    f.write(json.dumps(t.to_row()) + "\n")
    summary = [group_summary(g) for g in groups]
    if args.json:
        output.print_json({"mode": args.mode, "groups": summary, "out": args.out})
    else:
        output.print_table(f"bunshin rollout ({args.mode})", ["TASK", "GROUP", "OK", "FAILED", "MEAN REWARD",
                                                             "MAKESPAN S", "STATUSES"],
                           [(s["task"], s["group_id"], s["ok"], s["failed"], s["mean_reward"], s["makespan_s"],
                             " ".join(f"{k}={v}" for k, v in s["statuses"].items())) for s in summary])
        if args.out:
            output.err.print(f"wrote {sum(len(g.trajectories) for g in groups)} trajectories to {args.out}")
    return 1 if all(s["ok"] == 0 for s in summary) else 0  # partial failures are data, not a crash


def group_summary(g: Any) -> dict[str, Any]:
    rewards = [r for r in g.rewards if r is not None]
    statuses: dict[str, int] = {}
    for t in g.trajectories:
        statuses[t.status.value] = statuses.get(t.status.value, 0) + 1
    errors = sorted({t.error for t in g.trajectories if t.error})
    return {"task": g.task_id, "group_id": g.group_id, "n": len(g.trajectories), "ok": len(g.trajectories) - g.failed,
            "failed": g.failed, "mean_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
            "makespan_s": round(g.makespan_s, 3), "prepare_s": round(g.prepare_s, 3), "statuses": statuses,
            "errors": errors[:5]}
