"""``python -m bunshin_agent --socket PATH [--run-dir DIR]``: run the agent."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
from types import FrameType

from . import immortal
from .jobs import CALLS
from .server import Agent, AgentServer
from .wire import REBIND_SIGNAL


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class _Formatter(argparse.HelpFormatter):
    """A fixed width: the default asks ``shutil`` for the terminal's, and importing ``shutil``
    maps zlib, bz2 and lzma with their libraries (30 mappings) that every dump of a clone pays for."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bunshin_agent", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--socket", required=True, help="unix socket to listen on")
    parser.add_argument(
        "--run-dir",
        default="/run/bunshin",
        help="where identity.json, fork-id and session scripts go (default: /run/bunshin)",
    )
    parser.add_argument(
        "--calls",
        choices=CALLS,
        default="thread",
        help="serve each connection in a thread of the agent (default), or in a worker process "
        "forked for it (a forked clone then keeps ~0.5 MiB instead of ~0.9 MiB after its first calls, "
        "each call 2-10x slower)",
    )
    args = parser.parse_args(argv)
    # A workspace's pid 1 installs no handler: a signal without one is ignored when
    # sent from inside (`kill -TERM 1`, `pkill python`). The host removes a workspace
    # with SIGKILL.
    if os.getpid() == 1:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # not Python's KeyboardInterrupt
    else:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _exit_on_signal)
    # jobs and sessions listen beside the agent's socket
    agent = Agent(os.path.abspath(args.run_dir), os.path.dirname(os.path.abspath(args.socket)), args.calls)
    server = AgentServer(agent, os.path.abspath(args.socket))
    agent.start()
    try:
        server.bind()
        signal.signal(REBIND_SIGNAL, lambda _signum, _frame: server.heal())
        if args.calls == "thread":
            server.warm_up()  # before the freeze: a clone's first calls find the code specialised
        print(f"bunshin-agent: pid {os.getpid()} listening on {args.socket}", file=sys.stderr)
        # Everything allocated so far lives as long as the agent: keep the cyclic GC off
        # those objects, so that collections in a forked clone do not write (and so
        # copy) the pages they sit on.
        gc.collect()
        immortal.make_all_immortal()  # Python 3.12+; before the freeze (gc.get_objects skips frozen ones)
        gc.freeze()
        immortal.release_free_memory()
        server.serve_forever()
    except OSError as exc:
        print(f"bunshin-agent: {exc}", file=sys.stderr)
        return 1
    finally:
        server.close()
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
