"""``bench rollout --report DIR``: a markdown report, the raw results and PNG plots.

- ``memory.png``: system-wide used memory above idle over each phase (top) and the
  memory of this bunshin home alone (bottom), one column per workload, one line per mode.
- ``latency.png``: where a trajectory's time goes (workspace, think, tools, reward),
  mean per mode and workload, plus tool-call p50/p95.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import console as output

COLORS = {"baseline": "#c0392b", "copy": "#e67e22", "bunshin": "#2471a3", "bunshin:no-spec": "#5dade2",
          "bunshin:no-cache": "#8e44ad", "bunshin:no-fork": "#16a085"}


def write(result: dict[str, Any], directory: str | Path) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(output.to_jsonable(result), indent=1))
    plot_memory(result, out / "memory.png")
    plot_latency(result, out / "latency.png")
    (out / "report.md").write_text(markdown(result))
    return out / "report.md"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory(result: dict[str, Any], path: Path) -> None:
    """Top row: system-wide used memory above idle; bottom row: this bunshin home's own memory."""
    plt = _plt()
    workloads = list(result["plan"]["workloads"])
    fig, axes = plt.subplots(2, len(workloads), figsize=(6.5 * len(workloads), 7.6), squeeze=False)
    for col, name in enumerate(workloads):
        top, bottom = axes[0][col], axes[1][col]
        for p in (p for p in result["phases"] if p["workload"] == name):
            s, color = p["series"], COLORS.get(p["mode"])
            style = "--" if ":" in p["mode"] else "-"
            top.plot(s["t"], [(u - p["idle_bytes"]) / 2**30 for u in s["used"]], color=color, linewidth=1.6, ls=style,
                     label=f"{p['mode']} (peak {p['peak_bytes'] / 2**30:.2f} GiB, {p['gb_s']:.0f} GB·s)")
            bottom.plot(s["t"], [w / 2**30 for w in s["ws"]], color=color, linewidth=1.6, ls=style,
                        label=f"{p['mode']} (peak {p['ws_peak_bytes'] / 2**30:.2f} GiB, {p['ws_gb_s']:.0f} GB·s)")
        top.set_title(f"{name}: system-wide used memory above idle")
        bottom.set_title(f"{name}: workspaces + snapshot files only")
        for ax in (top, bottom):
            ax.set_xlabel("seconds since the phase started")
            ax.set_ylabel("GiB")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(result: dict[str, Any], path: Path) -> None:
    plt = _plt()
    parts = [("env_s", "workspace (create+setup / restore / fork)"), ("think_s", "model think time"),
             ("tools_s", "tool calls"), ("reward_s", "reward")]
    phases = result["phases"]
    labels = [f"{p['mode']}\n{p['workload']}" for p in phases]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    bottom = [0.0] * len(phases)
    for (key, label), color in zip(parts, ["#7f8c8d", "#f4d03f", "#2471a3", "#27ae60"], strict=True):
        vals = [p["breakdown_s"][key] or 0.0 for p in phases]
        ax.bar(labels, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylabel("seconds per trajectory (mean)")
    ax.set_title("where a trajectory's time goes")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    x = range(len(phases))
    ax2.bar([i - 0.2 for i in x], [p["tool_latency_s"]["p50"] * 1000 for p in phases], width=0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [p["tool_latency_s"]["p95"] * 1000 for p in phases], width=0.4, label="p95")
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("ms")
    ax2.set_title("tool call latency")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{-x * 100:+.0f} %"


def markdown(r: dict[str, Any]) -> str:
    hb = output.human_bytes
    plan = r["plan"]
    lines = [
        "# bunshin bench rollout",
        "",
        f"Group sizes {plan['group_sizes']}, {plan['tasks_per_workload']} tasks per workload, recorded think "
        f"times x{plan['think_scale']}, at most {plan['concurrency']} trajectories in flight (every mode). "
        f"Prefix cache available: {plan['cache_available']}. Wall time {r['wall_s']} s.",
        "",
        "Workloads:",
        *[f"- **{k}**: {v}" for k, v in plan["workloads"].items()],
        "",
        "## Per mode (both workloads)",
        "",
        "| mode | peak memory | Δ | memory-time (GB·s) | Δ | makespan (s) | Δ | tool p50 / p95 (ms) | "
        "own peak | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, m in r["modes"].items():
        v = r["vs_baseline"].get(label, {})
        lines.append(f"| {label} | {hb(m['peak_bytes'])} | {_pct(v.get('peak'))} | {m['gb_s']:.1f} | "
                     f"{_pct(v.get('gb_s'))} | {m['makespan_s']:.1f} | {_pct(v.get('makespan'))} | "
                     f"{m['tool_latency_s']['p50'] * 1000:.0f} / {m['tool_latency_s']['p95'] * 1000:.0f} | "
                     f"{hb(m['ws_peak_bytes'])} | {m['failed']}/{m['trajectories']} |")
    g = r["goals"]
    lines += [
        "",
        "Goals (bunshin against baseline; BunshinRL reports −43 % peak, −51 % total memory, −23 % latency): "
        + ", ".join(f"{k} {_pct(v['got'])} ({'met' if v['met'] else 'not met'})" for k, v in g.items()) + ".",
        "",
        f"Same rewards in every mode for the same traces: **{'yes' if r['same_rewards'] else 'no'}** "
        f"({r['rewards_compared']} trajectories compared"
        + (f"; mismatches: {', '.join(r['reward_mismatches'])}" if r["reward_mismatches"] else "") + ").",
        "",
        "## Per phase",
        "",
        "| mode | workload | peak | GB·s | own peak | makespan (s) | traj mean (s) | env (s) | think (s) | "
        "tools (s) | tool p50/p95 (ms) | cached calls | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r["phases"]:
        b = p["breakdown_s"]
        lines.append(f"| {p['mode']} | {p['workload']} | {hb(p['peak_bytes'])} | {p['gb_s']:.1f} | "
                     f"{hb(p['ws_peak_bytes'])} | {p['makespan_s']:.1f} | {p['trajectory_s']['mean']:.1f} | {b['env_s']:.2f} | "
                     f"{b['think_s']:.2f} | {b['tools_s']:.2f} | {p['tool_latency_s']['p50'] * 1000:.0f} / "
                     f"{p['tool_latency_s']['p95'] * 1000:.0f} | {p['cached_calls']}/{p['calls']} | "
                     f"{p['failed']}/{p['trajectories']} |")
    lines += [
        "",
        "Peak and GB·s are system-wide used memory (MemTotal − MemAvailable, tmpfs memory files included) above "
        "the idle level measured just before each phase, sampled every 100 ms. *Own peak* counts only this "
        "bunshin home (its workspace cgroups plus its snapshot memory files and layers): a cross-check that "
        "other activity on the machine cannot disturb.",
        "",
        "![memory over time](memory.png)",
        "",
        "![latency breakdown](latency.png)",
        "",
    ]
    return "\n".join(lines)
