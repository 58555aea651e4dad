"""``bench fork``: the tables on the terminal, and ``--report DIR`` (markdown, results, plot).

``fork.png``: restore time per clone (p50 and p90) against the number of clones (top
left), private memory per clone after restore / after one exec and tool call / after
the light work (top right), memory the clones add system-wide (bottom left) and the
time to remove them all (bottom right), bunshin against plain CRIU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import console as output
from .fork import LIGHT_WORK_S

COLORS = {"bunshin": "#2471a3", "copy": "#e67e22"}
MODES = ("bunshin", "copy")


def _rows(r: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return [s[mode] for s in r["sizes"] if mode in s]


def print_report(r: dict[str, Any]) -> None:
    hb = output.human_bytes
    f = r.get("first_fork", {})
    c = f.get("criu", {})
    output.print_table(
        f"first fork of a workspace holding {r['heap_mib']} MiB (load {r['host']['load_avg_1m']})",
        ["SNAPSHOT WALL MS", "PAUSE MS", "FREEZING MS", "MEMDUMP MS", "MEMWRITE MS", "DUMP WALL MS", "REWRITE MS",
         "RESTORE MS", "FORK WALL MS", "MEMORY FILES"],
        [(f.get("snapshot_wall_ms"), f.get("pause_ms"), c.get("freezing_ms"), c.get("memdump_ms"),
          c.get("memwrite_ms"), f.get("dump_ms"), f.get("rewrite_ms"), f.get("restore_ms"), f.get("fork_wall_ms"),
          hb(f.get("memfile_bytes", 0)))],
    )
    rows = []
    for size in r["sizes"]:
        for mode in MODES:
            if mode not in size:
                continue
            m = size[mode]
            n = f"{m['clones']}" + (f" (of {m['asked']}: capped)" if m.get("capped") else "")
            rows.append((mode, n, m["restore_ms_p50"], m["restore_ms_p90"], m["restore_wall_ms_per_clone"],
                         m["parent_pause_ms"], m["rewrite_ms"], hb(m["private_bytes_per_clone"]),
                         hb(m["private_bytes_after_call"]), hb(m["private_bytes_per_clone_after_work"]),
                         hb(m["total_added_bytes_after_call"]),
                         f"{hb(m['clones_added_bytes'])} ({m['clones_added_share_of_parent']:.0%})",
                         f"{m['remove_all_ms'] / 1000:.2f} s"))
    cold = r.get("cold") or {}
    if cold:
        rows.append(("cold start", cold["starts"], cold["start_ms_p50"], cold["start_ms_p99"], "", "", "", "", "",
                     "", "", "", ""))
    output.print_table(
        f"bunshin bench fork: {r['heap_mib']} MiB heap, {r['cpus']} CPUs, {hb(r['mem_total_bytes'])} RAM "
        "(copy mode capped to half the memory available after its dump)",
        ["MODE", "CLONES", "RESTORE P50 MS", "P90 MS", "WALL/CLONE MS", "PAUSE MS", "REWRITE MS", "PRIVATE/CLONE",
         "AFTER EXEC+TOOL", f"AFTER {LIGHT_WORK_S:.0f} S", "SYSTEM ADDED", "CLONES' CGROUPS (OF PARENT)",
         "REMOVE ALL"],
        rows,
    )
    if r.get("depth"):
        output.print_table(
            "forks of a running fork",
            ["DEPTH", "PAUSE MS", "DUMP MS", "REWRITE MS", "RESTORE MS", "IMAGE (DELTA)", "NEW MEMORY FILES",
             "CLONE PRIVATE"],
            [(d["depth"], d["parent_pause_ms"], d["dump_ms"], d["rewrite_ms"], d["restore_ms"], hb(d["image_bytes"]),
              hb(d["memfile_bytes"]), hb(d["private_bytes"])) for d in r["depth"]],
        )


def write(r: dict[str, Any], directory: str | Path) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(output.to_jsonable(r), indent=1))
    plot(r, out / "fork.png")
    (out / "report.md").write_text(markdown(r))
    return out / "report.md"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (only for --report)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    for mode in MODES:
        rows = _rows(r, mode)
        if not rows:
            continue
        n = [m["clones"] for m in rows]
        col = COLORS[mode]
        ax[0][0].plot(n, [m["restore_ms_p50"] for m in rows], "o-", color=col, label=f"{mode} p50")
        ax[0][0].plot(n, [m["restore_ms_p90"] for m in rows], "s--", color=col, alpha=0.6, label=f"{mode} p90")
        for key, style, what in (("private_bytes_per_clone", "o-", "after restore"),
                                 ("private_bytes_after_call", "s--", "after exec + tool call"),
                                 ("private_bytes_per_clone_after_work", "^:", f"after {LIGHT_WORK_S:.0f} s")):
            ax[0][1].plot(n, [m[key] / 2**20 for m in rows], style, color=col, label=f"{mode}, {what}")
        ax[1][0].plot(n, [m["total_added_bytes_after_call"] / 2**30 for m in rows], "o-", color=col,
                      label=f"{mode}: system-wide")
        ax[1][0].plot(n, [m["clones_added_bytes"] / 2**30 for m in rows], "s--", color=col,
                      label=f"{mode}: the clones' cgroups")
        ax[1][1].plot(n, [m["remove_all_ms"] / 1000 for m in rows], "o-", color=col, label=mode)
    titles = (("restore time per clone", "ms"), ("private memory per clone", "MiB"),
              ("memory added by the clones (and the snapshot)", "GiB"), ("removing all clones", "s"))
    ax[0][1].set_yscale("log")  # a copied clone holds the heap, a copy-on-write one a few MiB
    for a, (title, unit) in zip(ax.flat, titles, strict=True):
        a.set_title(title)
        a.set_xlabel("clones")
        a.set_ylabel(unit)
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        if a.lines:
            a.legend(fontsize=7)
    fig.suptitle(f"bench fork: {r['heap_mib']} MiB heap, {r['cpus']} CPUs, load {r['host']['load_avg_1m']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(r: dict[str, Any]) -> str:
    hb = output.human_bytes
    f = r.get("first_fork", {})
    c = f.get("criu", {})
    lines = [f"# bench fork: {r['heap_mib']} MiB heap", "",
             f"{r['cpus']} CPUs, {hb(r['mem_total_bytes'])} RAM, load {r['host']['load_avg_1m']} at the start, "
             f"{r.get('duration_s', '?')} s; host limits {r['host']}.", "",
             "## First fork", "",
             "| snapshot wall | pause (frozen) | freezing | memory drain | page write | dump wall | rewrite | restore |",
             "|---|---|---|---|---|---|---|---|",
             f"| {f.get('snapshot_wall_ms')} ms | {f.get('pause_ms')} ms | {c.get('freezing_ms')} ms | "
             f"{c.get('memdump_ms')} ms | {c.get('memwrite_ms')} ms | {f.get('dump_ms')} ms | {f.get('rewrite_ms')} ms | "
             f"{f.get('restore_ms')} ms |", "", "## Per size", "",
             "| mode | clones | restore p50 / p90 | wall per clone | pause | private: restore / exec+tool / after work "
             "| system added (after calls) | clones' cgroups | remove all |",
             "|---|---|---|---|---|---|---|---|---|"]
    for size in r["sizes"]:
        for mode in MODES:
            if mode not in size:
                continue
            m = size[mode]
            n = f"{m['clones']}" + (f" (of {m['asked']})" if m.get("capped") else "")
            lines.append(
                f"| {mode} | {n} | {m['restore_ms_p50']} / {m['restore_ms_p90']} ms | "
                f"{m['restore_wall_ms_per_clone']} ms | {m['parent_pause_ms']} ms | {hb(m['private_bytes_per_clone'])} / "
                f"{hb(m['private_bytes_after_call'])} / {hb(m['private_bytes_per_clone_after_work'])} | "
                f"{hb(m['total_added_bytes_after_call'])} | {hb(m['clones_added_bytes'])} | "
                f"{m['remove_all_ms'] / 1000:.2f} s |")
    lines += ["", "![fork](fork.png)", ""]
    return "\n".join(lines)
