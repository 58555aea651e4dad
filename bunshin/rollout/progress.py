"""A live progress display (rich, on stderr) fed by the engine's events."""

from __future__ import annotations

from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from .. import console as output
from .records import TrajectoryResult


class GroupProgress:
    """One bar per group: trajectories done, of which failed. Use as ``on_event`` and a context manager."""

    def __init__(self, label: str = "", *, transient: bool = True) -> None:
        self.label = label
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[note]}"), TimeElapsedColumn(),
                                 console=output.err, transient=transient)
        self._bars: dict[str, TaskID] = {}
        self._failed: dict[str, int] = {}

    def __enter__(self) -> GroupProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        prefix = f"{self.label} " if self.label else ""
        if kind == "group_start":
            self._bars[info["group_id"]] = self.progress.add_task(
                f"{prefix}{info['task']}", total=info["n"], note="")
        elif kind == "prepare_start":
            for gid, bar in self._bars.items():
                if gid.startswith(f"{info['task']}-g"):
                    self.progress.update(bar, note="preparing task root")
        elif kind == "trajectory_end":
            r: TrajectoryResult = info["result"]
            if r.group_id not in self._bars:
                return
            bar = self._bars[r.group_id]
            if not r.ok:
                self._failed[r.group_id] = self._failed.get(r.group_id, 0) + 1
            failed = self._failed.get(r.group_id, 0)
            self.progress.update(bar, advance=1, note=f"[red]{failed} failed[/]" if failed else "")
