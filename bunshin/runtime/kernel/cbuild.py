"""Small C helpers shipped as source and compiled with the host's gcc on first use.

Each build is keyed by the source and the flags (a changed helper is a new file), made
in a private temporary folder and renamed into place whole, so two builders at once
never see half a binary. Used for the frozen-layer copier (``upper_copy.c``) and the
restore's user-namespace owner library (``userns_owner.c``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ...errors import HostUnsupported


def build(package: str, source: str, cache_dir: Path, name: str, flags: Sequence[str], *, what: str,
          libs: Sequence[str] = (), mode: int = 0o700) -> Path:
    """``source`` (a file of ``package``, the caller's ``__package__``) compiled into ``cache_dir`` as ``name`` with the
    key inserted before its suffix (``upper-copy-KEY``, ``userns-owner-KEY.so``); ``what``
    names the helper in errors."""
    src = resources.files(package).joinpath(source).read_bytes()
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    stem, dot, suffix = name.partition(".")
    path = Path(cache_dir) / f"{stem}-{key}{dot}{suffix}"
    if path.exists():
        return path
    gcc = shutil.which("gcc")
    if gcc is None:
        raise HostUnsupported(f"gcc is needed to build {what}", hint="install gcc (make install does)")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(prefix=f"bunshin-{stem}-") as tmp:
        (Path(tmp) / source).write_bytes(src)
        out = Path(tmp) / name
        proc = subprocess.run([gcc, *flags, "-o", str(out), str(Path(tmp) / source), *libs],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise HostUnsupported(f"building {what} failed: {proc.stderr.strip()[-400:]}",
                                  hint="check that gcc works (make install installs it)")
        os.chmod(out, mode)
        os.replace(out, path)  # whole or not at all, also with two builders at once
    return path
