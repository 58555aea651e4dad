"""The command line's conventions (docker's and podman's), checked on the parser and one process each."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from bunshin import __version__
from bunshin.cli.main import build_parser, main

DEV_BENCHES = ("trap", "clone-memory", "delta-pause", "restore-phases", "memfile-copy", "read-bounds")


def _parsers(parser: argparse.ArgumentParser, path: str = "bunshin"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def _listed(parser: argparse.ArgumentParser) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest for a in sub._choices_actions}


def test_version_and_usage_errors_exit_as_docker():
    r = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "--version"], capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout) == (0, f"bunshin {__version__}\n")
    r = subprocess.run([sys.executable, "-m", "bunshin.cli.main", "ls", "--no-such-flag"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 125 and "unrecognized arguments: --no-such-flag" in r.stderr


def test_every_json_flag_is_documented():
    undocumented = [path for path, p in _parsers(build_parser())
                    for a in p._actions if a.dest == "json" and not a.help]
    assert undocumented == []


def test_snapshot_group_has_one_help_per_verb(capsys):
    parser = build_parser()
    group = dict(_parsers(parser))["bunshin snapshot"]
    assert _listed(group) == {"create", "save", "load", "rm", "ls"}
    helps = set()
    for verb in ("create", "save", "load", "rm", "ls"):
        with pytest.raises(SystemExit) as done:
            main(["snapshot", verb, "--help"])
        assert done.value.code == 0
        helps.add(capsys.readouterr().out)
    assert len(helps) == 5 and all("--json" in h for h in helps)
    assert "snapshot-rm" not in _listed(parser)  # the deprecated spelling works but is not offered


def test_developer_benches_are_grouped_and_old_names_still_parse():
    parser = build_parser()
    bench = dict(_parsers(parser))["bunshin bench"]
    assert _listed(dict(_parsers(parser))["bunshin bench dev"]) == set(DEV_BENCHES)
    assert not _listed(bench) & set(DEV_BENCHES) and {"fork", "rollout", "dev"} <= _listed(bench)
    for name in DEV_BENCHES:
        new = parser.parse_args(["bench", "dev", name, "--json"])
        old = parser.parse_args(["bench", name, "--json"])
        assert new.func is old.func and new.json and old.json


@pytest.mark.parametrize("argv, module", [(["bench", "dev", "read-bounds"], "read_bounds"),
                                          (["bench", "dev", "restore-phases"], "restore_phases"),
                                          (["bench", "runtime"], "runtime")])
def test_a_bench_prints_json_or_its_report(argv, module, monkeypatch, capsys):
    import importlib
    import json

    bench = importlib.import_module(f"bunshin.bench.{module}")
    shown = []
    monkeypatch.setattr(bench, "run", lambda *a, **kw: {"p50_ms": 1.5})
    monkeypatch.setattr(bench, "print_report", shown.append)
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"p50_ms": 1.5} and not shown
    assert main(argv) == 0
    assert shown == [{"p50_ms": 1.5}]
