"""Real multi-layer images for the image tests and ``bunshin bench image``, built here: a
busybox-static root (Debian's busybox-static), Debian's python3, host folders, layers
as tars packed as an OCI layout; skopeo turns them into ``docker save`` archives and
pushes them to a loopback registry (Debian's docker-registry, ``Registry``).

``Layer`` entries are (path, kind, data/target, mode, uid); kinds: file, dir, symlink,
hardlink, whiteout (``.wh.NAME``), opaque (``.wh..wh..opq`` in the folder), chr
(a device node), fifo. ``host`` copies a host file (or a folder, recursively).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSYBOX = Path("/bin/busybox")
APPLETS = ("sh", "ls", "cat", "id", "echo", "env", "pwd", "test", "touch", "rm", "mkdir", "whoami", "sleep",
           "true", "false", "stat", "grep", "wc", "head", "printf")


@dataclass
class Layer:
    entries: list[tuple[Any, ...]] = field(default_factory=list)
    compress: str = "gzip"  # gzip, none

    def add(self, *entry: Any) -> Layer:
        self.entries.append(entry)
        return self

    def tar_bytes(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for e in self.entries:
                _add(tar, *e)
        return buf.getvalue()


def _info(name: str, kind: bytes, mode: int, uid: int = 0) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = kind, mode, uid, uid, 1_700_000_000
    return ti


def _add(tar: tarfile.TarFile, path: str, kind: str, data: Any = None, mode: int = 0o644, uid: int = 0) -> None:
    if kind == "file":
        raw = data.encode() if isinstance(data, str) else (data or b"")
        ti = _info(path, tarfile.REGTYPE, mode, uid)
        ti.size = len(raw)
        tar.addfile(ti, io.BytesIO(raw))
    elif kind == "dir":
        tar.addfile(_info(path, tarfile.DIRTYPE, mode if mode != 0o644 else 0o755, uid))
    elif kind == "symlink":
        ti = _info(path, tarfile.SYMTYPE, 0o777, uid)
        ti.linkname = data
        tar.addfile(ti)
    elif kind == "hardlink":
        ti = _info(path, tarfile.LNKTYPE, mode, uid)
        ti.linkname = data
        tar.addfile(ti)
    elif kind == "whiteout":
        parent, _, name = path.rpartition("/")
        _add(tar, f"{parent}/.wh.{name}" if parent else f".wh.{name}", "file", b"", 0o600)
    elif kind == "opaque":
        _add(tar, f"{path}/.wh..wh..opq", "file", b"", 0o600)
    elif kind == "chr":
        ti = _info(path, tarfile.CHRTYPE, 0o666, uid)
        ti.devmajor, ti.devminor = data
        tar.addfile(ti)
    elif kind == "fifo":
        tar.addfile(_info(path, tarfile.FIFOTYPE, mode, uid))
    elif kind == "host":
        tar.add(data, arcname=path, recursive=True, filter=_host_filter)
    else:
        raise ValueError(kind)


def _host_filter(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in ti.name:
        return None
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def busybox_base() -> Layer:
    """A root with busybox-static, /etc/passwd (root, app=1000), /etc/group, /tmp."""
    layer = Layer()
    for d in ("bin", "etc", "tmp", "root", "home", "home/app", "usr", "usr/bin", "proc", "sys", "dev", "run"):
        layer.add(d, "dir", None, 0o1777 if d == "tmp" else 0o755, 1000 if d == "home/app" else 0)
    layer.add("bin/busybox", "file", BUSYBOX.read_bytes(), 0o755)
    for applet in APPLETS:
        layer.add(f"bin/{applet}", "symlink", "busybox")
    layer.add("etc/passwd", "file", "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    layer.add("etc/group", "file", "root:x:0:\napp:x:1000:\nstaff:x:50:app\n")
    return layer


def binaries_layer(*programs: str) -> Layer:
    """Host programs (e.g. /bin/bash) at the same paths, with the libraries they link."""
    layer = Layer()
    for d in ("bin", "lib", "lib/x86_64-linux-gnu", "lib64"):
        layer.add(d, "dir", None, 0o755)
    libs: dict[str, str] = {}
    for prog in programs:
        real = Path(prog).resolve()
        layer.add(prog.lstrip("/"), "file", real.read_bytes(), 0o755)
        out = subprocess.run(["ldd", str(real)], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            path = line.split("=>")[-1].split("(")[0].strip()
            if path.startswith("/"):
                dest = "lib64/ld-linux-x86-64.so.2" if "ld-linux" in path else f"lib/x86_64-linux-gnu/{Path(path).name}"
                libs[dest] = path
    for dest, path in sorted(libs.items()):
        layer.add(dest, "file", Path(path).resolve().read_bytes(), 0o755)
    return layer


def python_layer() -> Layer:
    """Debian's python3 (binary, the libraries it links, its standard library without
    tests and tools): enough for ``python3 -m unittest``."""
    binary = Path("/usr/bin/python3").resolve()
    version = binary.name  # python3.11 on Debian 12, python3.13 on Debian 13
    layer = Layer()
    for d in ("lib", "lib/x86_64-linux-gnu", "lib64", "usr/lib"):
        layer.add(d, "dir", None, 0o755)
    layer.add("usr/bin/python3", "file", binary.read_bytes(), 0o755)
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            dest = "lib64/ld-linux-x86-64.so.2" if "ld-linux" in path else f"lib/x86_64-linux-gnu/{Path(path).name}"
            layer.add(dest, "file", Path(path).resolve().read_bytes(), 0o755)
    skip = {"test", "idlelib", "tkinter", "lib2to3", "ensurepip", "pydoc_data", "turtledemo", "dist-packages",
            "site-packages", "__pycache__", "asyncio", "email", "xml", "html", "http", "urllib", "xmlrpc",
            "multiprocessing", "sqlite3", "curses", "dbm", "venv", "wsgiref", "distutils", "tomllib"}
    std = Path("/usr/lib") / version
    layer.add(f"usr/lib/{version}", "dir", None, 0o755)
    for child in sorted(std.iterdir()):
        if child.name not in skip and not child.name.startswith("config-") and not child.is_symlink():
            layer.add(f"usr/lib/{version}/{child.name}", "host", str(child))
    return layer


def _blob(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return f"sha256:{digest}"


def build_layout(dest: Path, layers: list[Layer], *, config: dict[str, Any] | None = None,
                 ref_name: str = "latest", multi_arch: bool = False) -> dict[str, Any]:
    """An OCI image layout at ``dest``; returns {"config": digest, "manifest": digest, "diff_ids": [...]}
    (and "index": the digest of the image index listing the manifest for linux/amd64, with
    ``multi_arch``)."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    descs, diff_ids = [], []
    for layer in layers:
        tar = layer.tar_bytes()
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        data = gzip.compress(tar, compresslevel=1, mtime=0) if layer.compress == "gzip" else tar
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if layer.compress == "gzip" else "")
        descs.append({"mediaType": media, "digest": _blob(blobs, data), "size": len(data)})
    doc = {"architecture": "amd64", "os": "linux", "config": config or {},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}}
    cfg_bytes = json.dumps(doc).encode()
    cfg_digest = _blob(blobs, cfg_bytes)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest,
                           "size": len(cfg_bytes)}, "layers": descs}
    man_bytes = json.dumps(manifest).encode()
    man_digest = _blob(blobs, man_bytes)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    top = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man_digest, "size": len(man_bytes)}
    out = {"config": cfg_digest, "manifest": man_digest, "diff_ids": diff_ids}
    if multi_arch:
        index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                            "manifests": [{**top, "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
        out["index"] = _blob(blobs, index)
        top = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": out["index"], "size": len(index)}
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {**top, "annotations": {"org.opencontainers.image.ref.name": ref_name}}]}))
    return out


def skopeo(*args: str) -> None:
    subprocess.run(["skopeo", "--insecure-policy", *args], check=True, capture_output=True, timeout=300)


def docker_archive(layout: Path, dest: Path, name: str) -> Path:
    """The same image as a ``docker save`` archive (skopeo's docker-archive), tagged ``name``."""
    skopeo("copy", f"oci:{layout}", f"docker-archive:{dest}:{name}")
    return dest


def oci_archive(layout: Path, dest: Path) -> Path:
    """The layout as an OCI archive (a tar of it)."""
    with tarfile.open(dest, "w") as tar:
        for p in sorted(layout.rglob("*")):
            tar.add(p, arcname=str(p.relative_to(layout)), recursive=False)
    return dest


def compress(src: Path, kind: str) -> Path:
    """``src`` compressed (gz or zst) beside it."""
    if kind == "gz":
        dest = src.with_suffix(src.suffix + ".gz")
        with open(src, "rb") as i, gzip.open(dest, "wb") as o:
            shutil.copyfileobj(i, o)
    else:
        dest = src.with_suffix(src.suffix + ".zst")
        subprocess.run(["zstd", "-q", "-f", str(src), "-o", str(dest)], check=True)
    os.sync()
    return dest


class Registry:
    """Debian's docker-registry on loopback (plain HTTP), storing under ``root``; a
    context manager that stops it (and waits for it) on exit."""

    def __init__(self, root: Path, htpasswd: Path | None = None) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.host = f"127.0.0.1:{self.port}"
        self.root = root
        auth = (f"auth:\n  htpasswd:\n    realm: test\n    path: {htpasswd}\n" if htpasswd else "")
        (root / "config.yml").write_text(
            f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
            f"http:\n  addr: {self.host}\n{auth}")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Registry:
        import time
        import urllib.error
        import urllib.request

        self.proc = subprocess.Popen(["docker-registry", "serve", str(self.root / "config.yml")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "log", "wb"))
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1)
                return self
            except urllib.error.HTTPError:
                return self  # 401: up, with auth
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("docker-registry did not start: " + (self.root / "log").read_text()) from None
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def push(self, layout: Path, name: str, *opts: str) -> str:
        """Push the layout as ``HOST/name`` (``opts``: skopeo's, e.g. ``--all``); the reference."""
        ref = f"{self.host}/{name}"
        skopeo("copy", "--dest-tls-verify=false", *opts, f"oci:{layout}", f"docker://{ref}")
        return ref
