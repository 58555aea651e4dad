"""Base images as overlay lower layers.

``host``: the host's own root, read-only, under a mask layer that hides bunshin's
own state. A directory: a root filesystem (for example one made by debootstrap).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..config import Config
from ..errors import ImageNotFound, RuntimeFailure

HOST = "host"
_OPAQUE_XATTR = "trusted.overlay.opaque"


def lower_layers(cfg: Config, image: str) -> list[Path]:
    """The read-only layers of ``image``, top first (without the agent layer)."""
    if image == HOST:
        return [mask_layer(cfg), Path("/")]
    path = Path(image)
    if not path.is_absolute():
        path = Path.cwd() / path
    if not path.is_dir():
        raise ImageNotFound(
            f"unknown image {image!r}",
            hint="use 'host' or the path of a directory holding a root filesystem",
        )
    if not any(path.iterdir()):
        raise ImageNotFound(f"image directory {path} is empty", hint="point --image at a root filesystem")
    return [path.resolve()]


# Host folders a workspace starts with empty, and their modes. They are plain
# folders of the workspace's own upper layer, not tmpfs mounts: CRIU dumps a tmpfs
# by running tar while the workspace is frozen (~4 ms each), an upper folder goes
# into the snapshot layer with the rest, and clones share it copy-on-write.
FRESH = {Path("/tmp"): 0o1777, Path("/run"): 0o755, Path("/dev"): 0o755}


def hidden_paths(cfg: Config) -> list[Path]:
    """Host folders a workspace on the host image must not see (none inside another)."""
    paths = {cfg.home.resolve(), Path("/var/lib/bunshin"), Path("/opt/bunshin"), *FRESH}
    return sorted(p for p in paths if not any(p != q and p.is_relative_to(q) for q in paths))


def mask_layer(cfg: Config) -> Path:
    """A layer of opaque, empty folders over every hidden host path (built once)."""
    hidden = hidden_paths(cfg)
    digest = hashlib.sha256("\n".join(map(str, hidden)).encode()).hexdigest()[:12]
    layer = cfg.tmpfs / "layers" / f"mask-{digest}"
    if layer.is_dir():
        return layer
    layer.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".mask-", dir=layer.parent))
    try:
        for p in hidden:
            d = tmp / p.relative_to("/")
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, FRESH.get(p, 0o755))
            os.setxattr(d, _OPAQUE_XATTR, b"y")
        os.rename(tmp, layer)
    except FileExistsError:
        pass
    except OSError as e:
        if not layer.is_dir():
            raise RuntimeFailure(f"cannot build the mask layer in {layer.parent}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return layer
