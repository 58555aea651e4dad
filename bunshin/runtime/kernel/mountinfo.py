"""The one parser of ``/proc/self/mountinfo`` (proc(5)): one typed record per mount.

A line reads ``36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue``:
mount id, parent id, major:minor, root within its filesystem, mount point, per-mount
options, optional fields up to a lone ``-``, then filesystem type, source and the
superblock's options. The kernel writes a space, tab, newline or backslash in a path
as an octal escape (``\\040``, ``\\011``, ``\\012``, ``\\134``); the records hold the
decoded text, so a mount point compares equal to ``os.path.realpath`` of its folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

PATH = "/proc/self/mountinfo"
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo, its paths decoded."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str  # the folder of the filesystem that is mounted
    mount_point: str
    options: str  # per-mount options, e.g. "rw,nosuid,relatime"
    optional: tuple[str, ...]  # e.g. ("shared:1", "master:2")
    fs_type: str
    source: str
    super_options: str  # the superblock's options, e.g. "rw,size=1024k,huge=advise"

    @classmethod
    def parse(cls, line: str) -> MountEntry:
        """One mountinfo line (a trailing newline is ignored); ``ValueError`` if malformed."""
        left, sep, right = line.rstrip("\n").partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 6:
            raise ValueError(f"not a mountinfo line: {line!r}")
        mount_id, parent_id, dev, root, mount_point, options, *optional = fields
        major, _, minor = dev.partition(":")
        fs_type, source, super_options = [*right.split(" ", 2), "", ""][:3]
        return cls(
            mount_id=int(mount_id), parent_id=int(parent_id), major=int(major), minor=int(minor),
            root=unescape(root), mount_point=unescape(mount_point), options=options,
            optional=tuple(optional), fs_type=fs_type, source=unescape(source), super_options=super_options,
        )

    def holds(self, path: str) -> bool:
        """Whether the absolute, resolved ``path`` is the mount point or beneath it."""
        return path == self.mount_point or path.startswith(self.mount_point.rstrip("/") + "/")


def unescape(text: str) -> str:
    """A mountinfo field with the kernel's octal escapes decoded."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


def parse(lines: Iterable[str]) -> list[MountEntry]:
    """The records of mountinfo text, one per non-empty line, in the kernel's order."""
    return [MountEntry.parse(line) for line in lines if line.strip()]


def read(path: str = PATH) -> list[MountEntry]:
    """The mounts of this process's mount namespace (parents before their children)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # paths are bytes, as os.fsdecode
        return parse(f)


def mount_points() -> list[str]:
    """Every mount point now, in order (a point mounted over appears more than once)."""
    return [m.mount_point for m in read()]


def at(path: str | os.PathLike[str]) -> MountEntry | None:
    """The visible mount at ``path`` (resolved), the last one made there; None if it is not a mount point."""
    target = os.path.realpath(path)
    found = None
    for m in read():
        if m.mount_point == target:
            found = m
    return found


def fs_type_of(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem ``path`` (resolved) lies on: its deepest, latest mount's; "?" if none."""
    best, fstype = "", "?"
    real = os.path.realpath(path)
    for m in read():
        if m.holds(real) and len(m.mount_point) >= len(best):
            best, fstype = m.mount_point, m.fs_type
    return fstype


def below(folder: str | os.PathLike[str]) -> list[str]:
    """Mount points strictly below ``folder`` (resolved), in order."""
    base = os.path.realpath(folder).rstrip("/") + "/"
    return [p for p in mount_points() if p.startswith(base)]
