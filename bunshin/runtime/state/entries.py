"""Removing what a folder holds without following links."""

from __future__ import annotations

import shutil
from pathlib import Path


def remove_entry(path: Path) -> None:
    """Delete ``path``: a real folder with everything in it, anything else (a symlink to a
    folder included) as itself; missing is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
