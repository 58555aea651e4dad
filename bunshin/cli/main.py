"""The ``bunshin`` command line (exit codes: ``bunshin.cli.exits``)."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from .. import console as output
from ..errors import BunshinError
from . import exits
from .workspace_cmds import register as register_workspace

JSON_HELP = ("print the result as one JSON object or list (the HTTP API's keys where it has the same "
             "thing); no colour, no progress")


def build_parser() -> argparse.ArgumentParser:
    parser = exits.Parser(
        prog="bunshin",
        description="Isolated, live-forkable workspaces for RL of tool-using agents.",
        epilog=exits.EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"bunshin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register_workspace(sub)
    from .fork_cmds import register as register_fork

    register_fork(sub)
    from .system_cmds import register as register_system

    register_system(sub)
    from .rollout_cmds import register as register_rollout

    register_rollout(sub)
    from .serve_cmds import register as register_serve

    register_serve(sub)
    from .image_cmds import register as register_image

    register_image(sub)
    from .cluster_cmds import register as register_cluster

    register_cluster(sub)
    from .desktop_cmds import register as register_desktop

    register_desktop(sub)
    from .network_cmds import register as register_network

    register_network(sub)
    document_json(parser)
    return parser


def document_json(parser: argparse.ArgumentParser) -> None:
    """Give every ``--json`` that has no help of its own the one description (every command
    that reports has ``--json``; ``bunshin CMD --help`` says what it does)."""
    for action in parser._actions:  # noqa: SLF001 (argparse has no public walk of its options)
        if action.dest == "json" and not action.help:
            action.help = JSON_HELP
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for child in dict.fromkeys(action.choices.values()):
                document_json(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "--" in argv:  # everything after the first `--` is the command to run, verbatim
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1 :]
    args = parser.parse_args(shorthand(argv))
    if hasattr(args, "cmd"):
        args.cmd = list(args.cmd or []) + tail
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        output.err.print("interrupted")
        return exits.INTERRUPTED
    except BunshinError as e:
        output.print_error(e)
        return exits.FAILED
    except OSError as e:  # a foreign error that escaped translation: still no traceback
        output.print_error(BunshinError(f"{e}", hint="run `bunshin doctor` to check the host"))
        return exits.FAILED
    finally:
        if getattr(args, "release_tmpfs", False):
            release_idle_tmpfs()


def shorthand(argv: list[str]) -> list[str]:
    """``bunshin snapshot WS`` is short for ``bunshin snapshot create WS``."""
    if argv[:1] != ["snapshot"]:
        return argv
    from .fork_cmds import SNAPSHOT_VERBS

    rest = argv[1:]
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        i += 2 if rest[i] == "--mode" else 1  # the options `snapshot create` takes, given first
    if i < len(rest) and rest[i] not in SNAPSHOT_VERBS:
        return ["snapshot", "create", *rest]
    return argv


def release_idle_tmpfs() -> None:
    """After a self-contained job (bench, demo, rollout): unmount bunshin's tmpfs if
    nothing of it is left in use, so the job leaves the machine as it found it."""
    from ..config import Config
    from ..runtime.container import statefs

    try:
        statefs.release(Config.from_env())
    except (OSError, BunshinError):
        pass  # best effort: `bunshin gc` does the same


if __name__ == "__main__":
    sys.exit(main())
