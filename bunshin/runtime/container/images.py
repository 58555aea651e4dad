"""Base images as overlay lower layers.

``host``: the host's own root, read-only, under a mask layer that shows only the
OS's own folders (``mask_entries``). A directory: a root filesystem (for example
one made by debootstrap). Anything else is an image reference (``name:tag``, an
id): the layers of an image in the store (``oci``), pulled first if it is not there
and the reference names its registry.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...config import DEFAULT_HOME, INSTALL_DIR, Config
from ...errors import ImageNotFound, InvalidArgument, RuntimeFailure
from ..oci import store as oci_store
from ..oci.records import ImageConfig, ImageRecord
from ..oci.refs import Reference, looks_like_ref
from ..state.store import Store

HOST = "host"
#: A full image id: names the stored image, whatever folders exist.
IMAGE_ID = re.compile(r"sha256:[0-9a-f]{64}")
_OPAQUE_XATTR = "trusted.overlay.opaque"


@dataclass(frozen=True)
class BaseImage:
    """What a workspace stacks on: its layers (top first, without the agent layer) and,
    for a stored OCI/Docker image, its id and run config."""

    lowers: tuple[Path, ...]
    image_id: str | None = None
    config: ImageConfig | None = None


def resolve(cfg: Config, store: Store, image: str, *, pull: bool = True) -> BaseImage:
    """``image`` ('host', a folder, or an image reference) as layers; a reference that
    names its registry is pulled when the store lacks it (with ``pull``). A full image
    id (``sha256:`` and 64 hex digits) is always the stored image, never a folder."""
    if not isinstance(image, str) or not image.strip():
        raise InvalidArgument(f"image {image!r} is empty",
                              hint="give 'host', an image reference or the path of a root filesystem folder")
    if names_folder(image):
        return BaseImage(tuple(lower_layers(cfg, image)))
    rec = stored_image(cfg, store, image, pull=pull)
    return BaseImage(tuple(oci_store.lowers(cfg, rec)), rec.id, rec.config)


def names_folder(image: str) -> bool:
    """Whether ``image`` means 'host' or a root filesystem folder rather than a stored image:
    the one rule every caller decides by (a full image id never names a folder)."""
    return not IMAGE_ID.fullmatch(image) and (
        image == HOST or Path(image).is_dir() or image.startswith(("/", "./", "../"))
        or not looks_like_ref(image) and not image.startswith("sha256:"))


def stored_image(cfg: Config, store: Store, ref: str, *, pull: bool = True) -> ImageRecord:
    """The stored image ``ref`` names (a reference, an id or an id prefix), pulled first when
    the store lacks it and the reference names its registry (with ``pull``)."""
    try:
        return oci_store.find(store, ref)
    except ImageNotFound:
        parsed = Reference.parse(ref) if looks_like_ref(ref) else None
        if not pull or parsed is None or not parsed.has_registry:
            raise ImageNotFound(f"unknown image {ref!r}: neither a folder nor a stored image",
                                hint="`bunshin image ls` lists stored images; `bunshin image pull REF` or "
                                     "`bunshin image load FILE` adds one; or give a root filesystem folder") from None
        from ..oci.pull import pull as pull_image  # noqa: PLC0415 (skopeo only when pulling)

        return pull_image(cfg, store, ref)


def lower_layers(cfg: Config, image: str) -> list[Path]:
    """The read-only layers of ``image`` ('host' or a folder), top first (without the agent layer)."""
    if not isinstance(image, str) or not image.strip():
        raise InvalidArgument(f"image {image!r} is empty",
                              hint="give 'host' or the path of a root filesystem folder (e.g. --image ./rootfs)")
    if image == HOST:
        return [mask_layer(cfg), Path("/")]
    path = Path(image)
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_dir():
        raise ImageNotFound(
            f"unknown image {image!r}",
            hint="use 'host', an image reference, or the path of a directory holding a root filesystem",
        )
    if not any(path.iterdir()):
        raise ImageNotFound(f"image directory {path} is empty", hint="point --image at a root filesystem")
    return [path.resolve()]


# Host folders a workspace starts with empty, and their modes. They are plain
# folders of the workspace's own upper layer, not tmpfs mounts: CRIU dumps a tmpfs
# by running tar while the workspace is frozen (~4 ms each), an upper folder goes
# into the snapshot layer with the rest, and clones share it copy-on-write.
FRESH = {Path("/tmp"): 0o1777, Path("/run"): 0o755, Path("/dev"): 0o755}

# The host image is an allow-list: of the host's top-level entries only the OS's own
# folders show (the usr-merge names may be symlinks). Everything else at the top is
# an empty folder (or whited out, for a file or symlink); /proc and /sys are empty
# mount points the runtime mounts on; FRESH ones are empty too (the upper holds them).
SHOWN_TOP = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "var"})
RUNTIME_TOP = {"proc": 0o555, "sys": 0o555}
# /var keeps only its symlinks into /run; every other entry (lib, log, cache, backups,
# mail, spool, tmp, opt, local, and whatever else a host keeps there) is emptied.
VAR_KEPT = frozenset({"lock", "run"})
# Secrets in /etc: files become empty, folders empty (globs matched when the layer is built).
ETC_SECRET_FILES = ("shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "machine-id",
                    "ssh/ssh_host_*_key", "security/opasswd", "krb5.keytab", "ipsec.secrets")
ETC_SECRET_DIRS = ("sudoers.d", "ssl/private", "ipsec.d/private", "wireguard", "letsencrypt",
                   "NetworkManager/system-connections")
MASK_FORMAT = "2"  # in the layer's digest: a layer built by an older rule is never reused


def hidden_paths(cfg: Config) -> list[Path]:
    """bunshin's own host folders (none inside another): hidden in the host image
    whatever else it shows, and never inside an image folder."""
    paths = {cfg.home.resolve(), DEFAULT_HOME, INSTALL_DIR, *FRESH}
    return sorted(p for p in paths if not any(p != q and p.is_relative_to(q) for q in paths))


@dataclass(frozen=True)
class MaskEntry:
    """One path of the mask layer: ``empty`` (an opaque empty folder), ``blank`` (an empty
    file), ``whiteout`` (hides a file or symlink) or ``parent`` (a plain folder on the way)."""

    path: Path
    kind: str
    mode: int
    uid: int = 0
    gid: int = 0


def _entry(path: Path, kind: str, mode: int | None = None) -> MaskEntry:
    try:
        st = os.lstat(path)
        uid, gid, host_mode = st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)
    except OSError:
        uid, gid, host_mode = 0, 0, 0o755
    if mode is None:
        mode = host_mode & ~(stat.S_ISUID | (stat.S_ISGID if kind == "blank" else 0))
    return MaskEntry(path, kind, mode, uid, gid)


def _hide(path: Path, mode: int | None = None) -> MaskEntry:
    """An empty folder over a folder, a whiteout over anything else."""
    if path.is_dir() and not path.is_symlink():
        return _entry(path, "empty", mode)
    return MaskEntry(path, "whiteout", 0)


def mask_entries(cfg: Config) -> list[MaskEntry]:
    """What the mask layer over the host's / holds, from the host as it is now; sorted
    (a parent before what is in it), nothing inside a hidden folder."""
    root = Path("/")
    hidden: dict[Path, MaskEntry] = {}
    for name in os.listdir(root):
        if name not in SHOWN_TOP:
            mode = RUNTIME_TOP.get(name, FRESH.get(root / name))
            hidden[root / name] = _hide(root / name, mode) if mode is None else _entry(root / name, "empty", mode)
    var = root / "var"
    if var.is_dir() and not var.is_symlink():
        for name in os.listdir(var):
            if name not in VAR_KEPT or not (var / name).is_symlink():
                hidden[var / name] = _hide(var / name, 0o1777 if name == "tmp" else None)
    etc = root / "etc"
    for pattern in ETC_SECRET_FILES:
        for path in etc.glob(pattern):
            if path.is_file() and not path.is_symlink():
                hidden[path] = _entry(path, "blank")
    for rel in ETC_SECRET_DIRS:
        if (etc / rel).is_dir() and not (etc / rel).is_symlink():
            hidden[etc / rel] = _entry(etc / rel, "empty")
    for path in hidden_paths(cfg):
        hidden.setdefault(path, _entry(path, "empty", FRESH.get(path)))
    kept = [e for e in hidden.values()
            if not any(e.path != q and e.path.is_relative_to(q) and hidden[q].kind in ("empty", "whiteout") for q in hidden)]
    parents = {p for e in kept for p in e.path.parents if p != root} - {e.path for e in kept}
    return sorted([*kept, *(_entry(p, "parent") for p in parents)], key=lambda e: e.path.parts)


def mask_layer(cfg: Config) -> Path:
    """The layer over the host's / that hides all but the OS (built once per content)."""
    entries = mask_entries(cfg)
    spec = "\n".join([MASK_FORMAT, *(f"{e.kind} {e.mode:o} {e.uid} {e.gid} {e.path}" for e in entries)])
    digest = hashlib.sha256(spec.encode()).hexdigest()[:12]
    layer = cfg.paths.layer(f"mask-{digest}")
    if layer.is_dir():
        return layer
    layer.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".mask-", dir=layer.parent))
    try:
        os.chmod(tmp, 0o755)
        for e in entries:
            _make(tmp / e.path.relative_to("/"), e)
        os.rename(tmp, layer)
    except FileExistsError:
        pass
    except OSError as e:
        if not layer.is_dir():
            raise RuntimeFailure(f"cannot build the mask layer in {layer.parent}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layer


def _make(path: Path, e: MaskEntry) -> None:
    if e.kind == "whiteout":  # overlayfs: a character device 0:0 hides the name below
        os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        return
    if e.kind == "blank":
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    else:
        path.mkdir()
        if e.kind == "empty":
            os.setxattr(path, _OPAQUE_XATTR, b"y")
    os.chown(path, e.uid, e.gid, follow_symlinks=False)
    os.chmod(path, e.mode)
