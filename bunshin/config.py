"""Host paths and defaults, in one place. Nothing else hard-codes a host path."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = Path("/var/lib/bunshin")
DEFAULT_TMPFS = Path("/dev/shm/bunshin")
INSTALL_DIR = Path("/opt/bunshin")  # what `make install` puts on the host (CRIU)
DEFAULT_CRIU = INSTALL_DIR / "criu" / "bin" / "criu"
DEFAULT_GHOST_LIMIT = 256 << 20
DEFAULT_IMAGE_MAX_BYTES = "32G"
DEFAULT_IMAGE_MAX_LAYERS = 125  # docker's overlay2 refuses more (its "max depth exceeded")


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
    # Host uids/gids that own what workspaces write, on disk (their layers and uppers);
    # a workspace's ids 0..id_count-1 map to a range of its own above it, root inside is
    # an unprivileged host id, never host root.
    id_base: int = 1_000_000_000
    id_count: int = 65536
    # Each workspace and clone gets a range of its own (``runtime.idranges``): range k is
    # id_base + k * id_count, k in 1..id_ranges; range 0 owns the layers on disk.
    id_ranges: int = 16384
    # The largest deleted-but-open file a fork carries (CRIU's --ghost-limit; its own
    # default is 1 MiB): bytes, or a size such as "64M" (checked where a fork uses it,
    # ``runtime.unforkable.ghost_limit``). The dump copies such a file's bytes into the
    # snapshot's images and every clone gets a copy of its own, charged to its memory.
    ghost_limit: int | str = DEFAULT_GHOST_LIMIT
    # How a copy-on-write fork keeps converted memory's Linux semantics: a
    # ``runtime.memfile.ZeroFillPolicy`` value ("trap": the SIGSYS handler; "copy": the
    # older allocator heuristic without it; "refuse"; "convert").
    memory_semantics: str = "trap"
    # Before a copy-on-write dump, convert the workspace's processes live into memory
    # files, pre-copied while they run (``runtime.precopy``): the dump is then a delta.
    # Only processes holding at least ``fork_precopy_min_mib`` of anonymous memory (at
    # least 16 MiB: below, CRIU's copy costs less than a conversion); the rest are left
    # to CRIU's dump. Faster from 64 MiB up, but below 1 GiB measured to hold more memory
    # in the demo's workload (README, "On by default"). A value that is
    # not a whole number of MiB is refused where a fork uses it (``precopy.min_bytes``).
    fork_precopy: bool = True
    fork_precopy_min_mib: int | str = 1024
    # CRIU's log level for a fork's dump (``-v``): 2, warnings and errors; 4 logs every
    # step (``bench delta-pause`` splits the pause at them), ~3,000 lines of which each is
    # a write inside the pause: ~2 ms of a delta's 13-15 ms here.
    dump_log_level: int = 2
    # The same for a restore (a kept log, ``snapshot.restore(keep_logs=True)``, is at -v4:
    # ``bench restore-phases`` splits it): ~2,000 lines, each a write on the restore's path.
    restore_log_level: int = 2
    # Caps on one image load, pull or build (``runtime.oci.caps``): the bytes its layers
    # unpack to (counted as they are written: a gzip or zstd bomb stops there; bytes, or a
    # size such as "32G") and its layer count (refused before anything is unpacked).
    image_max_bytes: int | str = DEFAULT_IMAGE_MAX_BYTES
    image_max_layers: int | str = DEFAULT_IMAGE_MAX_LAYERS
    # Workspaces with egress (``runtime.net``): each gets a /30 of this private pool; the
    # host's resolver forwards the names a policy allows to these servers (empty: the
    # nameservers of the host's /etc/resolv.conf).
    net_pool: str = "10.200.0.0/16"
    dns_upstream: tuple[str, ...] = ()

    @classmethod
    def from_env(cls) -> Config:
        """Defaults, overridden by ``BUNSHIN_HOME``, ``BUNSHIN_TMPFS``, ``BUNSHIN_CRIU``,
        ``BUNSHIN_GHOST_LIMIT`` (bytes, or with a K/M/G suffix), ``BUNSHIN_FORK_PRECOPY`` (1/0),
        ``BUNSHIN_FORK_PRECOPY_MIN_MIB``, ``BUNSHIN_IMAGE_MAX_BYTES`` and ``BUNSHIN_IMAGE_MAX_LAYERS``."""
        cfg = cls.for_home(
            Path(os.environ.get("BUNSHIN_HOME", DEFAULT_HOME)),
            tmpfs=Path(os.environ["BUNSHIN_TMPFS"]) if os.environ.get("BUNSHIN_TMPFS") else None,
            criu=Path(os.environ.get("BUNSHIN_CRIU", DEFAULT_CRIU)),
        )
        ghost = os.environ.get("BUNSHIN_GHOST_LIMIT")
        if ghost:
            cfg = dataclasses.replace(cfg, ghost_limit=ghost)
        if os.environ.get("BUNSHIN_FORK_PRECOPY") in ("1", "0"):
            cfg = dataclasses.replace(cfg, fork_precopy=os.environ["BUNSHIN_FORK_PRECOPY"] == "1")
        least = os.environ.get("BUNSHIN_FORK_PRECOPY_MIN_MIB")
        if least:
            cfg = dataclasses.replace(cfg, fork_precopy_min_mib=int(least) if least.isdigit() else least)
        # the image caps are checked where an image is loaded (``runtime.oci.caps``)
        if os.environ.get("BUNSHIN_IMAGE_MAX_BYTES"):
            cfg = dataclasses.replace(cfg, image_max_bytes=os.environ["BUNSHIN_IMAGE_MAX_BYTES"])
        if os.environ.get("BUNSHIN_IMAGE_MAX_LAYERS"):
            cfg = dataclasses.replace(cfg, image_max_layers=os.environ["BUNSHIN_IMAGE_MAX_LAYERS"])
        return cfg

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
    def paths(self) -> Paths:
        """Every host path bunshin uses under ``home`` and ``tmpfs``."""
        return Paths(self.home, self.tmpfs)

    @property
    def db_path(self) -> Path:
        return self.paths.db

    @property
    def snapshot_key_path(self) -> Path:
        """The secret (32 bytes, mode 0600) that signs the snapshot folders this home saves."""
        return self.paths.snapshot_key


@dataclass(frozen=True)
class Paths:
    """The one place host paths are joined (``Config.paths``).

    Under ``home`` (disk): the store, the snapshot key, benchmark downloads. Under
    ``tmpfs`` (memory): workspace folders, frozen layers, snapshot images, memory
    files and the idmapped views of host-owned layers.
    """

    home: Path
    tmpfs: Path

    @property
    def db(self) -> Path:
        """The SQLite store."""
        return self.home / "state.db"

    @property
    def snapshot_key(self) -> Path:
        """The secret (32 bytes, mode 0600) that signs the snapshot folders this home saves."""
        return self.home / "snapshot.key"

    @property
    def server_token(self) -> Path:
        """The API token of ``bunshin serve`` (made on first start, mode 0600)."""
        return self.home / "server.token"

    @property
    def sigsys(self) -> Path:
        """The SIGSYS handler converted memory gets, built once (``runtime.memfile.trapcode``)."""
        return self.home / "sigsys"

    @property
    def helpers(self) -> Path:
        """Small host programs built once from bunshin's C sources (``runtime.upper_copy``)."""
        return self.home / "helpers"

    @property
    def bench(self) -> Path:
        """Downloads of the benchmarks."""
        return self.home / "bench"

    @property
    def transfers(self) -> Path:
        """Snapshot archives on their way in or out of ``bunshin serve`` (removed when done)."""
        return self.home / "transfers"

    @property
    def images(self) -> Path:
        """The image store (disk, root only): unpacked layers, staging of loads and pulls."""
        return self.home / "images"

    @property
    def image_layers(self) -> Path:
        """Unpacked image layers, one folder per layer named by its diff id's hex
        (content-addressed: the sha256 of the layer's uncompressed tar)."""
        return self.images / "layers"

    @property
    def image_staging(self) -> Path:
        """Half-made layers and downloads, renamed into place or removed (same filesystem
        as ``image_layers``)."""
        return self.images / "staging"

    def image_layer(self, diff_id: str) -> Path:
        """The folder of the layer ``sha256:HEX`` (``image_layers/HEX``)."""
        return self.image_layers / diff_id.removeprefix("sha256:")

    @property
    def workspaces(self) -> Path:
        """One folder per workspace (its upper, work folder and root mount point)."""
        return self.tmpfs / "workspaces"

    @property
    def layers(self) -> Path:
        """Frozen layers: snapshot layers, the agent layer, mask layers."""
        return self.tmpfs / "layers"

    @property
    def snapshots(self) -> Path:
        """Snapshot folders (CRIU images), on their own tmpfs (``statefs``)."""
        return self.tmpfs / "snapshots"

    @property
    def mem(self) -> Path:
        """Memory files of cow snapshots."""
        return self.tmpfs / "mem"

    @property
    def idmap(self) -> Path:
        """Idmapped views of host-owned layers and shared folders."""
        return self.tmpfs / "idmap"

    def workspace(self, ws_id: str) -> Path:
        return self.workspaces / ws_id

    def snapshot(self, snap_id: str) -> Path:
        return self.snapshots / snap_id

    def layer(self, name: str) -> Path:
        return self.layers / name
