"""What an OCI/Docker image's config asks of every command: Env, WorkingDir, User.

The host passes them at launch (``BUNSHIN_IMAGE``, JSON ``{"env", "cwd", "user"}``);
clones keep them with the agent's memory. As ``docker run``: the environment is a
default PATH and HOME (the user's, from /etc/passwd) under the image's Env, the
folder is WorkingDir (else /), and the user (``name|uid[:group|gid]``) is looked up
in the image's own /etc/passwd and /etc/group when a command starts, with the
supplementary groups that name it. Without ``BUNSHIN_IMAGE`` nothing changes.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from .protocol import invalid

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Identity(NamedTuple):
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


class ImageDefaults(NamedTuple):
    env: dict[str, str]
    cwd: str
    user: str

    @classmethod
    def from_environ(cls) -> ImageDefaults | None:
        text = os.environ.pop("BUNSHIN_IMAGE", None)
        if not text:
            return None
        d: dict[str, Any] = json.loads(text)
        return cls({str(k): str(v) for k, v in d.get("env", {}).items()}, str(d.get("cwd") or "/"),
                   str(d.get("user") or ""))

    def identity(self) -> Identity | None:
        """The user to run as (None: root, as the agent)."""
        return _resolve(self.user) if self.user else None

    def environment(self, ident: Identity | None) -> dict[str, str]:
        home = ident.home if ident else _home_of(0)
        return {"PATH": DEFAULT_PATH, "HOME": home, **self.env}


def _entries(path: str) -> list[list[str]]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":") for line in f if line.strip() and not line.startswith("#")]
    except OSError:
        return []


def _home_of(uid: int) -> str:
    for e in _entries("/etc/passwd"):
        if len(e) >= 6 and e[2] == str(uid):
            return e[5] or "/"
    return "/root" if uid == 0 else "/"


def _resolve(spec: str) -> Identity:
    user, _, group = spec.partition(":")
    passwd = [e for e in _entries("/etc/passwd") if len(e) >= 7]
    entry = next((e for e in passwd if e[0] == user), None) if not user.isdigit() else \
        next((e for e in passwd if e[2] == user), None)
    if entry is None and not user.isdigit():
        raise invalid(f"unable to find user {user}: no matching entries in the image's /etc/passwd")
    uid = int(user) if user.isdigit() else int(entry[2])  # type: ignore[index]
    gid = int(entry[3]) if entry is not None and entry[3].isdigit() else 0
    groups = _entries("/etc/group")
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            match = next((g for g in groups if len(g) >= 3 and g[0] == group and g[2].isdigit()), None)
            if match is None:
                raise invalid(f"unable to find group {group}: no matching entries in the image's /etc/group")
            gid = int(match[2])
    name = entry[0] if entry is not None else None
    extra = tuple(sorted({int(g[2]) for g in groups if len(g) >= 4 and g[2].isdigit() and name
                          and name in g[3].split(",")} | {gid}))
    return Identity(uid, gid, extra, (entry[5] if entry is not None and entry[5] else "/"))


IMAGE = ImageDefaults.from_environ()
