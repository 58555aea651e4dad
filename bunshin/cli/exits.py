"""The CLI's exit codes, as docker's and podman's: bunshin's own failure apart from the command's.

``bunshin exec`` (and every command that runs one) exits with the command's own
status; the codes below are bunshin's, chosen so a script can tell them apart:

- 0: done.
- 1: a command that reports found a problem (``doctor``: a required check failed).
- 124: ``exec --timeout`` (or the default) ran out; the command was killed.
- 125: bunshin itself failed: bad input, no such workspace, a runtime error
  (an ``error:`` line and a ``hint:`` on stderr say what to do).
- 126: the command cannot be invoked (found, but not executable).
- 127: the command was not found (not on the workspace's ``PATH``).
- 128 + N: the command was killed by signal N; 130: bunshin was interrupted (Ctrl-C).
- 141: ``exec``: the command exited 0 but its output was cut at ``--max-output``.
- else: the command's own exit status.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

OK = 0
PROBLEM_FOUND = 1
TIMED_OUT = 124
FAILED = 125
CANNOT_INVOKE = 126
NOT_FOUND = 127
INTERRUPTED = 130
TRUNCATED = 141  # 128 + SIGPIPE: the reader stopped taking the command's output

EPILOG = ("exit codes: 125 bunshin failed (bad input, runtime error); 126 the command cannot be invoked; "
          "127 the command is not found; 124 it timed out; else the command's own status")


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors exit 125 (bunshin's own failure), not 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(FAILED, f"{self.prog}: error: {message}\n")
