"""The ``bunshin`` command line."""

from __future__ import annotations

import argparse
import sys

from .. import console as output
from ..errors import BunshinError
from .workspace_cmds import register as register_workspace


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bunshin",
        description="Isolated, live-forkable workspaces for RL of tool-using agents.",
    )
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "--" in argv:  # everything after the first `--` is the command to run, verbatim
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1 :]
    args = parser.parse_args(argv)
    if hasattr(args, "cmd"):
        args.cmd = list(args.cmd or []) + tail
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        output.err.print("interrupted")
        return 130
    except BunshinError as e:
        output.print_error(e)
        return 1
    except OSError as e:  # a foreign error that escaped translation: still no traceback
        output.print_error(BunshinError(f"{e}", hint="run `bunshin doctor` to check the host"))
        return 1
    finally:
        if getattr(args, "release_tmpfs", False):
            release_idle_tmpfs()


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
