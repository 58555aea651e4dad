"""The server's API token: a file under the home, made on first start, readable by root only."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..errors import InvalidArgument


def ensure_token(path: Path) -> str:
    """The token in ``path``, made (mode 0600, without following a symlink) if there is none.

    A token file others may read is refused: anyone who reads it can drive every workspace.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return _read(path)


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidArgument(f"token file {path}: {exc.strerror} (a symlink is refused)",
                              hint=f"remove {path} to have a new one made") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise InvalidArgument(f"token file {path} is readable by others (mode {st.st_mode & 0o777:o})",
                                  hint=f"chmod 600 {path}, or remove it to have a new one made")
        token = f.read().strip()
    if len(token) < 16:
        raise InvalidArgument(f"token file {path} holds no usable token (under 16 characters)",
                              hint=f"remove {path} to have a new one made")
    return token
