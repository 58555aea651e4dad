"""Host limits that bound how many clones can live at once, beyond memory and pids.

Every workspace's root is the same host uid (``Config.id_base``: the user namespaces
of all workspaces and clones map root there), so per-user kernel limits count every
clone on the machine together. The one met first at ~1,000 clones here is the pipe
buffer budget: ``fs.pipe-user-pages-soft`` (16384 pages by default) is the total a user
may hold in pipe buffers at the default 64 KiB before new pipes get one page, and CRIU
restores each pipe's size (``F_SETPIPE_SZ``), which is then refused (EPERM: "Can't
restore pipe size"). A clone holds one pipe or more (the agent's), so the default
allows ~1,000 pipes for all workspaces together. Raising the soft limit (0: none;
``fs.pipe-user-pages-hard`` still caps) is the host's decision: ``bunshin doctor`` says
so, and a restore that meets it fails with this hint.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import BunshinError, CriuError, ResourceExhausted

PIPE_PAGES = 16  # a pipe's default buffer: 64 KiB
PIPE_SOFT = Path("/proc/sys/fs/pipe-user-pages-soft")
PIPE_HINT = ("sysctl -w fs.pipe-user-pages-soft=0 (no soft limit on pipe buffers per user; "
             "fs.pipe-user-pages-hard still applies), or remove workspaces")


def pipe_soft_pages() -> int:
    try:
        return int(PIPE_SOFT.read_text())
    except (OSError, ValueError):
        return 16384  # the kernel's default


def pipes_allowed() -> int | None:
    """Pipes of the default size all workspaces together may hold; None: no soft limit."""
    soft = pipe_soft_pages()
    return None if soft == 0 else soft // PIPE_PAGES


def explain_restore_failure(err: CriuError, clones: int) -> BunshinError | None:
    """The host limit a failed restore met, as an error that says what to do; None if none."""
    if "Can't restore pipe size" in (err.first_errors or str(err)):
        allowed = pipes_allowed()
        return ResourceExhausted(
            f"restoring {clones} clones ran out of pipe buffers: every workspace's root is one host user, "
            f"and fs.pipe-user-pages-soft ({pipe_soft_pages()} pages) allows about {allowed} pipes of 64 KiB "
            "for all of them together",
            hint=PIPE_HINT,
        )
    return None
