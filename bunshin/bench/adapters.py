"""``bunshin bench adapters --framework miniswe``: a mini-swe-agent group of 8 on the coding
task, with and without the group fork, memory and makespan side by side.

The group is ``n`` mini-swe-agent runs of one task, each its own ``DefaultAgent`` in its own
thread over a :class:`~bunshin.adapters.miniswe.BunshinEnvironment` built from the
config mini-swe-agent would be given, driven by its ``DeterministicModel`` replaying one of
the rollout benchmark's coding traces as bash actions (``read_file`` as ``cat``, ``edit``
as an exact replace), with the traces' think times as the model's ``/sleep``. After the
agent submits, the task's reward command runs in its workspace. One mode after another,
memory sampled as in ``bunshin bench rollout``:

- ``baseline``: no group fork: each environment creates its workspace and runs the setup;
- ``fork``: ``group`` set: the first environment builds the root once, every one restores
  its workspace from it copy-on-write;
- ``fork:served``: the same through a ``bunshin serve`` host (in a thread of this process):
  each environment joins the server's group key over HTTP, as processes of a trainer would.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument
from ..rollout.policies import Trace
from ..rollout.task import TaskSpec
from .framework_group import group_result, group_task, report_cells
from .rollout import settle
from .sampler import MemorySampler, idle_used
from .stats import summary

FRAMEWORKS = ("miniswe", "skyrl")  # skyrl: bench/adapters_skyrl.py
MODES = ("baseline", "fork", "fork:served")
_EDIT = ("import pathlib, sys; p = pathlib.Path(sys.argv[1]); s = p.read_text(); "
         "n = s.count(sys.argv[2]); sys.exit(f'found {n} times, not once') if n != 1 else "
         "p.write_text(s.replace(sys.argv[2], sys.argv[3]))")


@dataclass(frozen=True)
class RunResult:
    reward: float | None
    env_s: float  # the environment's construction: its workspace (restore, or create + setup)
    total_s: float
    steps: int
    exit_status: str
    error: str | None


def as_command(name: str, args: dict[str, Any]) -> str:
    """A trace's tool call as the bash command a mini-swe-agent model would write."""
    if name == "bash":
        return str(args["command"])
    if name == "read_file":
        return f"cat {shlex.quote(args['path'])}"
    if name == "edit":
        return shlex.join(["python3", "-c", _EDIT, args["path"], args["old_str"], args["new_str"]])
    if name == "write_file":
        return shlex.join(["python3", "-c", "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
                           args["path"], args["content"]])
    raise InvalidArgument(f"no bash form for tool {name!r}")


def outputs(trace: Trace) -> list[dict[str, Any]]:
    """The scripted model's answers: a think (``/sleep``) before every action, then submit."""
    from minisweagent.models.test_models import make_output

    out = []
    for step in trace.steps:
        out.append(make_output("thinking", [{"command": f"/sleep {step.think_s}"}]))
        out.append(make_output("next step", [{"command": as_command(step.tool_call.name, step.tool_call.arguments)}]))
    out.append(make_output("thinking", [{"command": f"/sleep {trace.final_think_s}"}]))
    out.append(make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}]))
    return out


def env_config(cfg: Config, task: TaskSpec, group: str | None) -> dict[str, Any]:
    """The ``environment:`` section of a mini-swe-agent config for ``task``."""
    if any(s.run is None or s.background for s in task.setup):
        raise InvalidArgument(f"task {task.id}: only plain shell setup steps map onto mini-swe-agent's env")
    return {"environment_class": "bunshin.adapters.miniswe.BunshinEnvironment", "home": str(cfg.home),
            "cwd": task.workdir, "timeout": int(task.call_timeout), "memory": str(task.memory or "2G"),
            "pids": task.pids or 512, "files": dict(task.files), "setup": [s.run for s in task.setup],
            "group": group}


def _reward(env: Any, task: TaskSpec) -> float | None:
    if task.reward is None:
        return None
    r = env.ws.exec(["/bin/sh", "-c", task.reward.command], timeout=task.reward.timeout, cwd=task.workdir)
    nums = re.findall(r"-?\d+(?:\.\d+)?", r.stdout)
    return float(nums[-1]) if nums else None


def drive(config: dict[str, Any], task: TaskSpec, trace: Trace) -> RunResult:
    """One mini-swe-agent run: its environment from ``config``, its own agent loop, the reward."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel

    t0 = time.perf_counter()
    env: Any = get_environment(config)
    env_s = time.perf_counter() - t0
    try:
        agent = DefaultAgent(DeterministicModel(outputs=outputs(trace), cost_per_call=0.0), env,
                             system_template="You are a coding agent.", instance_template="{{task}}",
                             step_limit=4 * len(trace.steps) + 8, cost_limit=0)
        result = agent.run(task.prompt)
        reward = _reward(env, task)
        return RunResult(reward, round(env_s, 3), round(time.perf_counter() - t0, 3), agent.n_calls,
                         str(result.get("exit_status", "")), None)
    except Exception as e:  # a broken run is reported, its group finishes
        return RunResult(None, round(env_s, 3), round(time.perf_counter() - t0, 3), 0, "error", repr(e))
    finally:
        env.close()


@contextmanager
def _host(cfg: Config, served: bool) -> Iterator[dict[str, Any]]:
    """Nothing, or a server on loopback over ``cfg`` and how environments reach it."""
    if not served:
        yield {}
        return
    from ..server.thread import serve_in_thread

    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="bunshin-bench-") as d, serve_in_thread(cfg, token) as url:
        path = os.path.join(d, "token")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(token)
        yield {"url": url, "token_file": path}


def run_mode(cfg: Config, label: str, task: TaskSpec, traces: list[Trace]) -> dict[str, Any]:
    from ..adapters.miniswe import release_group

    key = f"bench-{task.id}-{uuid.uuid4().hex[:8]}" if label != "baseline" else None
    idle = idle_used(1.0)
    with _host(cfg, label == "fork:served") as host, MemorySampler(cfg) as sampler:
        config = {**env_config(cfg, task, key), **host}
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(len(traces)) as pool:
                results = list(pool.map(lambda tr: drive(config, task, tr), traces))
        finally:
            if key is not None:
                release_group(key, url=host.get("url"), token_file=host.get("token_file"))
        makespan = time.perf_counter() - t0
    s = sampler.series
    return {
        "label": label, "group_fork": key is not None, "makespan_s": round(makespan, 3),
        "peak_bytes": s.peak(idle), "gb_s": round(s.gb_s(idle), 3),
        "ws_peak_bytes": s.ws_peak(), "ws_gb_s": round(s.ws_gb_s(), 3),
        "env_s": summary([r.env_s for r in results]), "run_s": summary([r.total_s for r in results]),
        "exit_status": [r.exit_status for r in results], "rewards": [r.reward for r in results],
        "errors": [r.error for r in results if r.error],
    }


def run(cfg: Config, *, framework: str = "miniswe", group: int = 8, think_scale: float = 0.5,
        workload: str = "coding", modes: tuple[str, ...] = MODES, settle_s: float = 2.0) -> dict[str, Any]:
    """Every mode in turn on one task of ``workload``."""
    if framework == "skyrl":
        from . import adapters_skyrl

        return adapters_skyrl.run(cfg, group=group, think_scale=think_scale, workload=workload, settle_s=settle_s,
                                  **({} if modes == MODES else {"modes": modes}))
    if framework not in FRAMEWORKS:
        raise InvalidArgument(f"unknown framework {framework!r}", hint=f"one of {', '.join(FRAMEWORKS)}")
    work, task, traces = group_task(cfg, modes=modes, known=MODES, group=group, workload=workload,
                                    think_scale=think_scale, settle_s=settle_s)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bunshin-mswea-") as quiet:
        # mini-swe-agent prints a banner and makes a config folder when imported: not here
        os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
        os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", quiet)
        for label in modes:
            output.err.print(f"[dim]mini-swe-agent: {label}, group of {group}[/]")
            rows.append(run_mode(cfg, label, task, traces))
            settle(settle_s)
    return group_result("mini-swe-agent", work.name, task.id, group, think_scale, rows)


def print_report(r: dict[str, Any]) -> None:
    if r["framework"] == "skyrl-gym":
        from . import adapters_skyrl

        return adapters_skyrl.print_report(r)
    rows = [(*report_cells(m), " ".join("-" if x is None else f"{x:g}" for x in m["rewards"]))
            for m in r["modes"]]
    output.print_table(f"bunshin bench adapters --framework miniswe: a group of {r['group']} on {r['workload']} "
                       f"({r['task']}), think x{r['think_scale']}",
                       ["MODE", "PEAK MEM", "GB·S", "OWN PEAK", "MAKESPAN S", "ENV P50 S", "REWARDS"], rows)
    output.out.print(f"same rewards in every mode: {'yes' if r['same_rewards'] else 'NO'}")
    for m in r["modes"]:
        for e in m["errors"]:
            output.err.print(f"[red]{m['label']}: {e}[/]")
