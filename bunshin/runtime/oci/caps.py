"""Caps on one image load, pull or build: the bytes its layers unpack to and its layers.

An image is untrusted input, and its compressed size says nothing of what it unpacks
to: deflate reaches ~1,000:1, zstd ~30,000:1 (runs of zeros), so a few MiB can hold
TiBs. ``Budget`` is charged as a layer is unpacked, per chunk, before the chunk is
written (the larger of the layer's tar stream and the bytes written to files: a GNU
sparse member writes more than its tar holds); past ``Config.image_max_bytes`` the
unpack stops with ``PayloadTooLarge`` and the store removes the layer's staging folder.
The layer count (``Config.image_max_layers``, docker's 125 by default: overlayfs
stacks at most 500 lowers and every fork adds one) is refused before a layer is read.
What a helper program writes (skopeo's download, buildah's storage) is bounded by
``Watch``: the folder is measured every ``period`` seconds and the program killed past
its cap (it may overshoot by what it writes in one period).
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from ...config import Config
from ...errors import InvalidArgument, PayloadTooLarge
from ..kernel.limits import byte_size

BYTES_HINT = ("raise the cap if you trust the image: --max-size SIZE (image load/pull/build), "
              "BUNSHIN_IMAGE_MAX_BYTES or Config.image_max_bytes (e.g. 64G)")
LAYERS_HINT = ("an image of that many layers cannot be stacked here; squash it (buildah --squash, "
               "docker build --squash) or raise the cap: --max-layers N, BUNSHIN_IMAGE_MAX_LAYERS or "
               "Config.image_max_layers")


def max_bytes(cfg: Config) -> int:
    """``cfg.image_max_bytes`` in bytes."""
    return byte_size(cfg.image_max_bytes, "image size cap (image_max_bytes)",
                     "set BUNSHIN_IMAGE_MAX_BYTES, --max-size or Config.image_max_bytes to bytes or e.g. 32G")


def max_layers(cfg: Config) -> int:
    """``cfg.image_max_layers``: a whole number >= 1 (at most overlayfs's 500 lowers)."""
    raw = cfg.image_max_layers
    if isinstance(raw, bool) or not str(raw).strip().isdigit() or not 1 <= int(str(raw).strip()) <= 500:
        raise InvalidArgument(f"image layer cap (image_max_layers) {raw!r} is not a whole number from 1 to 500",
                              hint="set BUNSHIN_IMAGE_MAX_LAYERS, --max-layers or Config.image_max_layers")
    return int(str(raw).strip())


def check_layers(cfg: Config, count: int, where: str) -> None:
    """Refuse an image of more layers than ``cfg`` allows, naming the cap."""
    cap = max_layers(cfg)
    if count > cap:
        raise PayloadTooLarge(f"{where}: the image has {count} layers, more than the layer cap "
                              f"image_max_layers={cap}; nothing was unpacked", hint=LAYERS_HINT)


class Budget:
    """The bytes an image may still unpack to; ``charge`` refuses what goes past the cap."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.used = 0

    @classmethod
    def of(cls, cfg: Config) -> Budget:
        return cls(max_bytes(cfg))

    @property
    def left(self) -> int:
        return self.cap - self.used

    def refuse(self, what: str) -> PayloadTooLarge:
        return PayloadTooLarge(f"{what} goes past the image size cap image_max_bytes={self.cap} bytes "
                               f"({self.cap / (1 << 30):.4g} GiB): stopped there, nothing of it is kept",
                               hint=BYTES_HINT)

    def check(self, n: int, what: str) -> None:
        """Refuse unless ``n`` more bytes (not yet charged) fit."""
        if n > self.left:
            raise self.refuse(what)

    def charge(self, n: int, what: str) -> None:
        self.check(n, what)
        self.used += n


def folder_bytes(root: Path) -> int:
    """The disk space (allocated blocks) of the files below ``root``, not crossing into
    another filesystem (a mount of the tree, such as buildah's merged overlay)."""
    try:
        dev = os.stat(root).st_dev
    except OSError:
        return 0
    total, todo = 0, [str(root)]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue  # removed meanwhile
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != dev:
                continue
            total += st.st_blocks * 512
            if e.is_dir(follow_symlinks=False):
                todo.append(e.path)
    return total


class Watch:
    """While entered: kill ``proc`` once ``folder`` holds more than ``cap`` bytes
    (``folder_bytes``, every ``period`` s, in a thread); ``over``: the size seen then.
    No ``folder``: nothing is watched. ``kill``: how (``proc.kill`` by default)."""

    def __init__(self, proc: subprocess.Popen[str], folder: Path | None, cap: int, period: float,
                 kill: Callable[[], None] | None = None) -> None:
        self.proc, self.folder, self.cap, self.period = proc, folder, cap, period
        self.kill = kill or proc.kill
        self.over: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.folder is not None and not self._done.wait(self.period):
            size = folder_bytes(self.folder)
            if size > self.cap:
                self.over = size
                self.kill()
                return

    def __enter__(self) -> Watch:
        if self.folder is not None:
            self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
