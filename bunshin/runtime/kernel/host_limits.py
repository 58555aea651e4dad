"""Per-user kernel limits, as they bound one workspace (never all of them together).

The kernel counts pipe buffers (``fs.pipe-user-pages-soft``) and keys
(``kernel.keys.maxkeys``/``maxbytes``) per host uid, and inotify instances and watches
(``fs.inotify.max_user_*``), POSIX message queue bytes, pending signals and processes per
user namespace owner at the host's level. Each workspace and each clone has a host id
range of its own, whose first id is root inside and its user namespace's owner
(``idranges``): every one of these budgets is a workspace's own, so one that exhausts
any of them (pipes sized up with ``F_SETPIPE_SZ``, ``inotify_init`` until EMFILE,
queues until EMFILE, queued signals until EAGAIN, keys until EDQUOT) fails only itself;
other workspaces and host root keep theirs.

What is left per workspace is the kernel's per-user default. The one a workspace meets
first is its pipe budget: ``fs.pipe-user-pages-soft`` (16384 pages) allows ~1,000
pipes of 64 KiB, after which its new pipes get two pages and CRIU's restore of a larger
pipe (``F_SETPIPE_SZ``) is refused (EPERM: "Can't restore pipe size"). A clone gets a
fresh budget, so a fork fails this way only when the workspace itself held that many
pipe buffers (a restore that meets it says so, with ``PIPE_HINT``).
"""

from __future__ import annotations

from pathlib import Path

from ...errors import BunshinError, CriuError, ResourceExhausted

PIPE_PAGES = 16  # a pipe's default buffer: 64 KiB
PIPE_SOFT = Path("/proc/sys/fs/pipe-user-pages-soft")
PIPE_HINT = ("the workspace holds more pipe buffers than one user may (fs.pipe-user-pages-soft): "
             "close pipes in it, or raise the limit (sysctl -w fs.pipe-user-pages-soft=0: none; "
             "fs.pipe-user-pages-hard still applies)")


def pipe_soft_pages() -> int:
    try:
        return int(PIPE_SOFT.read_text())
    except (OSError, ValueError):
        return 16384  # the kernel's default


def pipes_allowed() -> int | None:
    """Pipes of the default size one workspace may hold; None: no soft limit."""
    soft = pipe_soft_pages()
    return None if soft == 0 else soft // PIPE_PAGES


def explain_restore_failure(err: CriuError, clones: int) -> BunshinError | None:
    """The host limit a failed restore met, as an error that says what to do; None if none."""
    if "Can't restore pipe size" in (err.first_errors or str(err)):
        allowed = pipes_allowed()
        return ResourceExhausted(
            f"restoring {clones} clones ran out of pipe buffers: each clone's root is a host user of its own, "
            f"and fs.pipe-user-pages-soft ({pipe_soft_pages()} pages) allows it about {allowed} pipes of 64 KiB; "
            "the snapshot holds more",
            hint=PIPE_HINT,
        )
    return None
