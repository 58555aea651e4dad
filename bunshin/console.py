"""Console output shared by the CLI and the benchmarks: JSON for machines, rich tables for people, errors that say what to do."""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .errors import BunshinError

out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False)


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2) + "\n")


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    out.print(table)


def print_error(e: BaseException) -> None:
    if isinstance(e, BunshinError):
        err.print(f"[bold red]error:[/] {e.message}", markup=True, soft_wrap=True)
        if e.hint:
            err.print(f"[yellow]hint:[/] {e.hint}", markup=True, soft_wrap=True)
        log_tail = e.details.get("log_tail")
        if log_tail:
            err.print("--- log tail ---\n" + log_tail, markup=False)
    else:
        err.print(f"error: {type(e).__name__}: {e}", markup=False)


@contextmanager
def progress(what: str, *, quiet: bool = False) -> Iterator[None]:
    """A spinner with the elapsed time on stderr while a long step runs (``what``: what
    it does); none with ``quiet`` (``--json``) or when stderr is not a terminal."""
    if quiet or not err.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        bar.add_task(what, total=None)
        yield


def deprecated(old: str, new: str) -> None:
    """One line on stderr: ``old`` still works but ``new`` is the way."""
    err.print(f"[yellow]deprecated:[/] `{old}` will go; use `{new}`", markup=True, soft_wrap=True)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
