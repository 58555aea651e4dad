"""The image-move row of ``bunshin bench cluster``: an image sent from one host's server to
another's by digest (``bunshin.client.images.copy_image``), through the head.

Two real ``bunshin serve`` servers (in threads of this process, on loopback, each on
its own home, sharing one snapshot key as a cluster's hosts do) and an image built
here (busybox, the host's bash, Debian's python3 standard library, a small top layer;
no network). Measured: the whole image to an empty host; the same image to a host
holding its two lower layers (only the two upper ones go); and once more to a host
that holds it all (nothing goes: the cost of asking). Each: layers sent and skipped,
bytes, seconds, MiB/s. The first move from a holder also makes each layer's tar
digest once (a pass over the layer), which later moves reuse.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ..client import Client
from ..client.images import copy_image
from ..config import Config
from ..runtime.container import statefs
from ..runtime.oci import store as oci_store
from ..runtime.state.store import Store
from ..server.thread import serve_in_thread
from . import oci_build as ob

MiB = 1 << 20
TOKEN = "bench-image-move-token-0123456789"
NAME = "bench/image-move:1"


def _home(root: Path, name: str, key: bytes, criu: Path) -> Config:
    cfg = Config.for_home(root / name, criu=criu)
    cfg.home.mkdir(parents=True)
    fd = os.open(cfg.snapshot_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key)
    os.close(fd)
    return cfg


def _layers() -> list[ob.Layer]:
    py = ob.python_layer()
    py.compress = "none"
    return [ob.busybox_base(), ob.binaries_layer("/bin/bash"), py,
            ob.Layer().add("srv", "dir").add("srv/data", "file", os.urandom(256 << 10))]


def run(cfg: Config) -> dict[str, Any]:
    """The three moves, as rows."""
    cfg.paths.bench.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="image-move-", dir=cfg.paths.bench))
    try:
        key = os.urandom(32)
        src, empty, partial = (_home(root, n, key, cfg.criu) for n in ("src", "empty", "partial"))
        layers = _layers()
        ob.build_layout(root / "full", layers)
        ob.build_layout(root / "lower", layers[:2])
        with Store.open(src.db_path) as s:
            oci_store.load(src, s, root / "full", tags=[NAME])
        with Store.open(partial.db_path) as s:
            oci_store.load(partial, s, root / "lower")
        rows = []
        with serve_in_thread(src, TOKEN) as us, serve_in_thread(empty, TOKEN) as ue, \
                serve_in_thread(partial, TOKEN) as up:
            with Client(us, token=TOKEN) as cs, Client(ue, token=TOKEN) as ce, Client(up, token=TOKEN) as cp:
                for what, target in (("to an empty host", ce), ("to a host holding the 2 lower layers", cp),
                                     ("again, to a host holding it all", ce)):
                    t0 = time.perf_counter()
                    moved = copy_image(cs.images, target.images, NAME)
                    dt = time.perf_counter() - t0
                    rows.append({"move": what, "layers_sent": len(moved.layers_sent),
                                 "layers_skipped": len(moved.layers_skipped), "bytes": moved.bytes,
                                 "seconds": round(dt, 3), "mib_per_s": round(moved.bytes / MiB / dt, 1) if dt else 0.0})
        return {"image_layers": len(layers), "rows": rows}
    finally:
        for name in ("src", "empty", "partial"):  # the servers' tmpfs, if one was mounted
            statefs.release(Config.for_home(root / name, criu=cfg.criu))
        shutil.rmtree(root, ignore_errors=True)
