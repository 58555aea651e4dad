"""``bunshin bench desktop``: a desktop with an app open, forked, against plain CRIU and a
cold start; and a computer-use rollout group, baseline against bunshin.

Fork part, side by side in one run: a parent workspace runs a desktop (Xvfb, jwm) with
``app`` open on a document. Then

- ``bunshin``: one copy-on-write snapshot of it, ``clones`` restores one after another;
- ``copy``: the same with plain CRIU (every page copied into each clone);
- ``cold``: boot a new desktop and open the app, ``cold`` times, until its window shows.

For each: restore (or start) p50/p90 in ms, private memory per clone (``Anonymous`` of
its processes) right after the restore, system-wide memory added for all clones, and how
many clones' first screenshot equals the parent's pixel for pixel. Then two clones are
given different input and the parent's and their screens are saved (``--report DIR``:
``parent.png``, ``clone-a.png``, ``clone-b.png``, ``report.md``, ``results.json``).

Rollout part: a task with ``desktop: true`` whose setup opens the app, ``group``
trajectories replaying computer-use traces (screenshot, click, type, key, screenshot)
with the desktop tools, through the rollout engine in ``baseline`` (a new desktop and
setup per trajectory) and ``bunshin`` (one task root, a fork per trajectory): makespan,
peak memory added, rewards.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops

from ..config import Config
from ..errors import HostUnsupported, InvalidArgument
from ..rollout import Mode, RolloutEngine, TraceReplayPolicy, parse_task, parse_traces
from ..runtime.state.records import SnapshotMode
from ..tools import ToolSet
from ..workspace import Workspace
from ..workspace.batch import remove_all
from ..workspace.desktop import Desktop, DesktopSpec
from .sampler import HomeMemory, MemorySampler
from .stats import percentile, system_used_bytes

#: The app each bench opens, how, and where to click and type in it (on 1280x800).
APPS: dict[str, dict[str, Any]] = {
    "gnumeric": {"argv": ["gnumeric", "--geometry=900x600+0+0", "/root/sheet.csv"], "click": (300, 300),
                 "doc": ("/root/sheet.csv", "a,b\n1,2\n")},
    "mousepad": {"argv": ["mousepad", "/root/notes.txt"], "click": (300, 300),
                 "doc": ("/root/notes.txt", "notes\n")},
    "xedit": {"argv": ["xedit", "-geometry", "900x600+0+0", "/root/notes.txt"], "click": (400, 400),
              "doc": ("/root/notes.txt", "notes\n")},
}


@dataclass(frozen=True)
class DesktopPlan:
    """What ``bunshin bench desktop`` runs."""

    app: str = "gnumeric"
    clones: int = 16
    cold: int = 3
    group: int = 8
    think_s: float = 0.5
    modes: tuple[str, ...] = ("cow", "copy")
    rollout: bool = True

    def __post_init__(self) -> None:
        if self.app not in APPS:
            raise InvalidArgument(f"unknown app {self.app!r}", hint=f"one of {', '.join(APPS)}")
        if not 2 <= self.clones <= 256 or not 0 <= self.cold <= 20 or not 1 <= self.group <= 64:
            raise InvalidArgument("clones must be 2..256, cold 0..20 and group 1..64",
                                  hint="e.g. --clones 16 --cold 3 --group 8")


def _need(app: str) -> None:
    missing = [p for p in ("Xvfb", "jwm", "xdotool", "xwd", APPS[app]["argv"][0]) if shutil.which(p) is None]
    if missing:
        raise HostUnsupported(f"bench desktop needs {', '.join(missing)} on this host",
                              hint="run `make install` (xvfb, x11-apps, xdotool, jwm, and the apps)")


def _png_pixels(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png)).convert("RGB")


def same_pixels(a: bytes, b: bytes) -> bool:
    return ImageChops.difference(_png_pixels(a), _png_pixels(b)).getbbox() is None


def open_app(cfg: Config, app: str) -> Workspace:
    """A new desktop workspace with ``app`` open on its document (its window showing)."""
    ws = Workspace.create("host", memory="2G", config=cfg, desktop=True)
    try:
        path, text = APPS[app]["doc"]
        ws.files.write(path, text)
        desk = Desktop.of(ws)
        desk.launch(APPS[app]["argv"], wait=30)
        if not desk.windows():
            raise HostUnsupported(f"{app} showed no window in 30 s", hint=f"try it: bunshin desktop launch WS -- {app}")
        time.sleep(0.5)
        return ws
    except BaseException:
        ws.remove()
        raise


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def cold_starts(cfg: Config, plan: DesktopPlan) -> dict[str, Any]:
    times = []
    for _ in range(plan.cold):
        t0 = time.perf_counter()
        ws = open_app(cfg, plan.app)
        times.append(_ms(t0))
        ws.remove()
    return {"n": len(times), "start_ms_p50": round(percentile(times, 50), 1),
            "start_ms_p90": round(percentile(times, 90), 1), "start_ms": [round(t, 1) for t in times]}


def fork_side(cfg: Config, parent: Workspace, mode: str, plan: DesktopPlan, parent_png: bytes) -> dict[str, Any]:
    """``plan.clones`` restores of one snapshot of ``parent`` in ``mode``; what they cost."""
    home = HomeMemory(cfg)
    used0, home0 = system_used_bytes(), home.cgroups() + home.files()
    t0 = time.perf_counter()
    snap = parent.snapshot(mode=SnapshotMode(mode))
    snapshot_ms = _ms(t0)
    clones: list[Workspace] = []
    try:
        times = []
        for _ in range(plan.clones):
            t1 = time.perf_counter()
            clones += snap.restore(1)
            times.append(_ms(t1))
        time.sleep(1.0)
        added, home_added = system_used_bytes() - used0, home.cgroups() + home.files() - home0
        anon = [c.stats().memory.anon_bytes for c in clones]
        equal = sum(same_pixels(Desktop.of(c).screenshot(), parent_png) for c in clones)
    finally:
        remove_all(clones)
        snap.remove()
    return {"mode": mode, "clones": plan.clones, "snapshot_ms": round(snapshot_ms, 1),
            "restore_ms_p50": round(percentile(times, 50), 1), "restore_ms_p90": round(percentile(times, 90), 1),
            "private_bytes_per_clone": int(percentile(anon, 50)), "home_added_bytes": int(home_added),
            "system_added_bytes": int(added), "pixel_equal_clones": equal}


def diverge(parent: Workspace, plan: DesktopPlan, out: Path | None, parent_png: bytes) -> dict[str, Any]:
    """Two clones given different text; whether their screens differ (and the PNGs)."""
    a, b = parent.fork(2)
    try:
        x, y = APPS[plan.app]["click"]
        shots = []
        for ws, text in ((a, "typed in clone A"), (b, "clone B typed this")):
            d = Desktop.of(ws)
            d.click(x, y)
            d.type_text(text)
            d.press("Return")
            time.sleep(0.5)
            shots.append(d.screenshot())
    finally:
        remove_all([a, b])
    if out is not None:
        for name, png in (("parent.png", parent_png), ("clone-a.png", shots[0]), ("clone-b.png", shots[1])):
            (out / name).write_bytes(png)
    return {"clones_differ": not same_pixels(shots[0], shots[1]),
            "a_differs_from_parent": not same_pixels(shots[0], parent_png),
            "b_differs_from_parent": not same_pixels(shots[1], parent_png)}


# --- the rollout group ---------------------------------------------------------------


def rollout_task(plan: DesktopPlan) -> Any:
    path, text = APPS[plan.app]["doc"]
    argv = " ".join(APPS[plan.app]["argv"])
    return parse_task({
        "id": f"desktop-{plan.app}", "desktop": True, "memory": "2G", "files": {path: text},
        "setup": [{"run": f"DISPLAY=:0 HOME=/root {argv} >/dev/null 2>&1", "background": True},
                  "for i in $(seq 300); do n=$(DISPLAY=:0 xprop -root _NET_CLIENT_LIST | grep -c 0x); "
                  "[ \"$n\" -gt 0 ] && sleep 0.5 && exit 0; sleep 0.1; done; exit 1"],
        "reward": "DISPLAY=:0 xprop -root _NET_CLIENT_LIST | grep -q 0x && echo 1 || echo 0",
        "max_turns": 10, "call_timeout": 60, "trajectory_timeout": 600,
    })


def rollout_traces(plan: DesktopPlan, task_id: str) -> list[Any]:
    x, y = APPS[plan.app]["click"]
    lines = []
    for i in range(plan.group):
        steps = [{"name": "screenshot", "arguments": {}, "think_s": plan.think_s},
                 {"name": "left_click", "arguments": {"x": x, "y": y}, "think_s": plan.think_s},
                 {"name": "type_text", "arguments": {"text": f"trajectory {i}"}, "think_s": plan.think_s},
                 {"name": "press_key", "arguments": {"keys": "Return"}, "think_s": plan.think_s},
                 {"name": "screenshot", "arguments": {}, "think_s": plan.think_s}]
        lines.append(json.dumps({"id": f"cu-{i}", "task": task_id, "steps": steps,
                                 "final": {"think_s": 0.1, "content": "done"}}))
    return parse_traces(lines, source="bench desktop traces")


async def _group(cfg: Config, mode: Mode, plan: DesktopPlan) -> Any:
    task = rollout_task(plan)
    policy = TraceReplayPolicy(rollout_traces(plan, task.id))
    async with RolloutEngine(mode, tools=ToolSet.desktop(), config=cfg, concurrency=plan.group) as engine:
        return await engine.run_group(task, policy, plan.group)


def rollout_side(cfg: Config, mode: Mode, plan: DesktopPlan) -> dict[str, Any]:
    idle = system_used_bytes()
    with MemorySampler(cfg) as sampler:
        t0 = time.perf_counter()
        group = asyncio.run(_group(cfg, mode, plan))
        makespan = time.perf_counter() - t0
    trajs = group.trajectories
    return {"mode": mode.value, "group": plan.group, "makespan_s": round(makespan, 2),
            "home_peak_bytes": int(sampler.series.ws_peak()), "home_gb_s": round(sampler.series.ws_gb_s(), 3),
            "system_peak_added_bytes": int(sampler.series.peak(idle)), "prepare_s": round(group.prepare_s, 2),
            "rewards": [t.reward for t in trajs], "failed": group.failed,
            "errors": [t.error for t in trajs if t.error][:3]}


# --- the whole bench -------------------------------------------------------------------


def run(cfg: Config, plan: DesktopPlan, *, out: Path | None = None,
        say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    _need(plan.app)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    say(f"parent: a desktop with {plan.app} open")
    t0 = time.perf_counter()
    parent = open_app(cfg, plan.app)
    result: dict[str, Any] = {"plan": asdict(plan), "desktop": DesktopSpec().to_dict(),
                              "parent_start_ms": round(_ms(t0), 1), "parent_anon_bytes": 0}
    try:
        parent_png = Desktop.of(parent).screenshot()
        result["parent_anon_bytes"] = parent.stats().memory.anon_bytes
        for mode in plan.modes:
            say(f"{mode}: {plan.clones} clones")
            result[{"cow": "bunshin", "copy": "copy"}[mode]] = fork_side(cfg, parent, mode, plan, parent_png)
        say("two clones, different input")
        result["diverged"] = diverge(parent, plan, out, parent_png)
    finally:
        parent.remove()
    if plan.cold:
        say(f"cold: {plan.cold} starts")
        result["cold"] = cold_starts(cfg, plan)
    if plan.rollout:
        result["rollout"] = {}
        for mode in (Mode.BASELINE, Mode.BUNSHIN):
            say(f"rollout group of {plan.group}: {mode.value}")
            result["rollout"][mode.value] = rollout_side(cfg, mode, plan)
    if out is not None:
        (out / "results.json").write_text(json.dumps(result, indent=2))
        (out / "report.md").write_text(report_markdown(result))
    return result


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def report_markdown(r: dict[str, Any]) -> str:
    """The report: the fork table, the rollout table and the three screens."""
    p = r["plan"]
    rows = ["| | restore/start p50 | p90 | private per clone | memory added, all clones (home / system) "
            "| pixel-equal |", "|---|---|---|---|---|---|"]
    for key in ("bunshin", "copy"):
        if key in r:
            s = r[key]
            rows.append(f"| {key} | {s['restore_ms_p50']} ms | {s['restore_ms_p90']} ms | "
                        f"{_mib(s['private_bytes_per_clone'])} | {_mib(s['home_added_bytes'])} / "
                        f"{_mib(s['system_added_bytes'])} | "
                        f"{s['pixel_equal_clones']}/{s['clones']} |")
    if "cold" in r:
        c = r["cold"]
        rows.append(f"| cold start | {c['start_ms_p50']} ms | {c['start_ms_p90']} ms | "
                    f"{_mib(r['parent_anon_bytes'])} (a desktop's own) | - | - |")
    lines = [f"# bunshin bench desktop: {p['app']} open, {p['clones']} clones", "",
             "home: what this bunshin home holds (its workspaces' cgroups and its tmpfs files), the "
             "number other processes cannot disturb; system: MemTotal - MemAvailable.", "", *rows, ""]
    d = r.get("diverged", {})
    lines += [f"Two clones given different input: screens differ: {d.get('clones_differ')}; each differs from "
              f"the parent: {d.get('a_differs_from_parent')}, {d.get('b_differs_from_parent')}.", ""]
    if "rollout" in r:
        lines += [f"## Computer-use rollout group ({p['group']} trajectories)", "",
                  "| mode | makespan | peak memory (home / system added) | memory-time (home) | task root build "
                  "| rewards |", "|---|---|---|---|---|---|"]
        for mode, s in r["rollout"].items():
            lines.append(f"| {mode} | {s['makespan_s']} s | {_mib(s['home_peak_bytes'])} / "
                         f"{_mib(s['system_peak_added_bytes'])} | {s['home_gb_s']} GB*s | {s['prepare_s']} s | "
                         f"{s['rewards']} |")
        lines.append("")
    lines += ["## Screens", "", "| parent | clone A | clone B |", "|---|---|---|",
              "| ![parent](parent.png) | ![clone A](clone-a.png) | ![clone B](clone-b.png) |", ""]
    return "\n".join(lines)


def print_report(r: dict[str, Any]) -> None:
    print(report_markdown(r))
