"""The frozen copy of a workspace's upper, taken at the dump instant and charged to it.

CRIU records the sizes of open overlay files, so the upper must be copied while the
tasks are frozen: CRIU's ``post-dump`` action script is the moment. The copy's
pages are charged to the workspace's memory cgroup (its family pays for the layers
its forks leave), but moving a process into a v1 memory cgroup costs ~14 ms, which
would be paid inside the pause. So a copier is started in the cgroup *before* the
dump and waits on a fifo; the action script only wakes it and waits for its exit
status (~1 ms).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

from .criu import Placement


@contextlib.contextmanager
def frozen_copy(upper: Path, layer: Path, folder: Path, memcg: Path | None) -> Iterator[Path]:
    """Yield the action script to give ``criu dump``; the copier is gone on exit."""
    go, done = folder / "copy-go", folder / "copy-done"
    os.mkfifo(go, 0o600)
    os.mkfifo(done, 0o600)
    script = folder / "freeze-upper.sh"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"echo go > {shlex.quote(str(go))} && read rc < {shlex.quote(str(done))} && exit \"$rc\"\n"
    )
    script.chmod(0o700)
    copy = (f"read x < {shlex.quote(str(go))} || exit 1; "
            f"cp -a --sparse=always {shlex.quote(str(upper))} {shlex.quote(str(layer))}; "
            f"echo $? > {shlex.quote(str(done))}")
    into = Placement(cgroup_procs=(str(memcg / "cgroup.procs"),) if memcg is not None else ())
    copier = subprocess.Popen(["sh", "-c", copy], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, close_fds=True, preexec_fn=into.enter)
    try:
        yield script
    finally:
        if copier.poll() is None:
            copier.kill()
        copier.wait()
        for f in (go, done):
            f.unlink(missing_ok=True)
