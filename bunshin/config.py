"""Host paths and defaults, in one place. Nothing else hard-codes a host path."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/bunshin")
DEFAULT_TMPFS = Path("/dev/shm/bunshin")
DEFAULT_CRIU = Path("/opt/bunshin/criu/bin/criu")


@dataclass(frozen=True)
class Config:
    """Where bunshin keeps its state.

    ``home``: the SQLite store, workspace uppers, frozen layers, saved snapshots.
    ``tmpfs``: memory files of snapshots (must be tmpfs: shared page cache).
    ``criu``: the CRIU binary (>= 4.2).
    """

    home: Path = DEFAULT_HOME
    tmpfs: Path = DEFAULT_TMPFS
    criu: Path = DEFAULT_CRIU
    cgroup_prefix: str = "bunshin-"
    # Host uids/gids that a workspace's ids 0..id_count-1 map to (its user namespace):
    # root inside is this unprivileged host id, never host root.
    id_base: int = 1_000_000_000
    id_count: int = 65536

    @classmethod
    def from_env(cls) -> Config:
        """Defaults, overridden by ``BUNSHIN_HOME``, ``BUNSHIN_TMPFS``, ``BUNSHIN_CRIU``."""
        return cls.for_home(
            Path(os.environ.get("BUNSHIN_HOME", DEFAULT_HOME)),
            tmpfs=Path(os.environ["BUNSHIN_TMPFS"]) if os.environ.get("BUNSHIN_TMPFS") else None,
            criu=Path(os.environ.get("BUNSHIN_CRIU", DEFAULT_CRIU)),
        )

    @classmethod
    def for_home(cls, home: Path, *, tmpfs: Path | None = None, criu: Path = DEFAULT_CRIU) -> Config:
        """A config whose tmpfs folder and cgroup names are private to ``home``.

        Two homes never touch each other's workspaces, not even through ``gc``.
        """
        home = Path(home).resolve()
        if home == DEFAULT_HOME:
            return cls(home=home, tmpfs=tmpfs or DEFAULT_TMPFS, criu=criu)
        tag = hashlib.sha256(str(home).encode()).hexdigest()[:6]
        return cls(
            home=home,
            tmpfs=tmpfs or Path(f"{DEFAULT_TMPFS}.{tag}"),
            criu=criu,
            cgroup_prefix=f"bunshin.{tag}-",
        )

    @property
    def db_path(self) -> Path:
        return self.home / "state.db"

    @property
    def workspaces_dir(self) -> Path:
        return self.home / "workspaces"

    @property
    def layers_dir(self) -> Path:
        return self.home / "layers"

    @property
    def snapshots_dir(self) -> Path:
        return self.home / "snapshots"

    @property
    def snapshot_key_path(self) -> Path:
        """The secret (32 bytes, mode 0600) that signs the snapshot folders this home saves."""
        return self.home / "snapshot.key"
