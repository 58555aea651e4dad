"""The CLI reference: every command's and subcommand's ``--help``, walked from the parser."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from bunshin.cli.main import build_parser


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # aliases share a parser
                    seen.add(id(sub))
                    yield name, sub


def _walk(parser: argparse.ArgumentParser, path: list[str]) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    yield path, parser
    for name, sub in _subcommands(parser):
        yield from _walk(sub, [*path, name])


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps help to the terminal: fixed, so the page is stable
    parser = build_parser()
    out = ["# CLI reference", "",
           "Generated from the `bunshin` parser at build time: each command's `--help`.", ""]
    for path, sub in _walk(parser, ["bunshin"]):
        if len(path) == 1:
            continue
        title = " ".join(path)
        out += [f"## `{title}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)
