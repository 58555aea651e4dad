"""The home's snapshot key and the MAC made with it (a saved snapshot's manifest,
``snapshot_checks``; an image moved between hosts, ``oci.exchange``). The hosts of a
cluster share one key (``bunshin.cluster.serve_proc``)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from ...config import Config
from ...errors import RuntimeFailure

_MAC_PREFIX = "hmac-sha256:"


def home_key(cfg: Config, *, create: bool) -> bytes | None:
    """This home's snapshot key (32 random bytes, mode 0600), made on first save."""
    path = cfg.snapshot_key_path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        key = os.urandom(32)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{key[:4].hex()}")
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(wfd, key)
            os.fsync(wfd)
            os.close(wfd)
            os.link(tmp, path)  # all or nothing: a concurrent first save keeps its own key
            return key
        except FileExistsError:
            return home_key(cfg, create=False)
        finally:
            tmp.unlink(missing_ok=True)
    try:
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise RuntimeFailure(f"{path} is not a snapshot key (32 bytes)",
                             hint="remove it: folders saved before then need --trust")
    return key


def mac(key: bytes | None, manifest: dict[str, Any]) -> str:
    """The MAC of a manifest: HMAC-SHA256 of its canonical JSON without the ``mac`` field."""
    assert key is not None
    body = {k: v for k, v in manifest.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return _MAC_PREFIX + hmac.new(key, text.encode(), hashlib.sha256).hexdigest()
