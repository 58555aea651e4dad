"""Loading a snapshot folder back (the format and what is checked: ``folder``): the folder is
untrusted input, copied into this home's tmpfs once, hashed on the way, and used only from there."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import Any

import psutil

from ...config import Config
from ...errors import (
    ImageNotFound,
    InvalidArgument,
    ResourceExhausted,
    StateConflict,
)
from .. import memfile
from ..agent_host import bundle as agent_bundle
from ..container import images, statefs
from ..container import lifecycle as container
from ..kernel import syscalls as sc
from ..state.store import Store
from . import image_policy, precopy
from . import lifetime as rsnap_lifetime
from . import sweeping as rsnap_sweeping
from .checks import (
    _IMAGE_NAME,
    _SHA256,
    _TRUST_HINT,
    _UNSIGNED_FORMATS,
    FORMAT,
    MAX_MANIFEST_BYTES,
    MEMFILE_NAME,
    _authenticate,
    check_layers,
    check_memfiles,
    check_record,
    check_tar_members,
    rel_parts,
)
from .folder import _CHUNK, _TAR_XATTRS, MANIFEST, _copy_range, _run


@dataclasses.dataclass
class _Folder:
    """A snapshot folder's checked manifest and its files, opened once below the folder."""

    src: Path
    record: rsnap_lifetime.SnapshotRecord
    layers: list[dict[str, Any]]
    memfiles: list[dict[str, Any]]
    hashes: dict[str, str] | None  # None: trusted, not checked
    fds: dict[str, int]

    def size(self, rel: str) -> int:
        return os.fstat(self.fds[rel]).st_size


def load(cfg: Config, store: Store, src: Path, *, trust: bool = False) -> rsnap_lifetime.SnapshotRecord:
    """Copy a saved snapshot back under ``cfg.tmpfs`` and record it (kept).

    Without ``trust`` only a folder this home saved, unchanged, loads; with it any
    folder does, but everything else is still checked (see the module docstring).
    """
    src = Path(src).absolute()
    try:
        dfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgument(f"{src} holds no saved snapshot ({e.strerror})",
                              hint="give a folder `snapshot save` wrote") from e
    fds: dict[str, int] = {}
    try:
        folder = _open_folder(cfg, store, src, dfd, trust, fds)
        return _load(cfg, store, folder)
    finally:
        for fd in fds.values():
            os.close(fd)
        os.close(dfd)


def _read_manifest(src: Path, dfd: int) -> dict[str, Any]:
    def no_constant(c: str) -> None:
        raise ValueError(f"{c} is not a number")

    try:
        fd = _open_below(dfd, MANIFEST, MANIFEST)
        try:
            if os.fstat(fd).st_size > MAX_MANIFEST_BYTES:
                raise InvalidArgument(f"{src / MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
            with os.fdopen(os.dup(fd), "rb") as f:
                manifest = json.loads(f.read(), parse_constant=no_constant)
        finally:
            os.close(fd)
    except (OSError, ValueError, InvalidArgument) as e:
        raise InvalidArgument(f"{src} holds no saved snapshot ({e})", hint="give a folder `snapshot save` wrote") from e
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, *_UNSIGNED_FORMATS):
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise InvalidArgument(f"{src} is in format {found!r}, not {FORMAT!r}")
    return manifest


def _open_folder(cfg: Config, store: Store, src: Path, dfd: int, trust: bool, fds: dict[str, int]) -> _Folder:
    """Check the manifest (MAC first unless ``trust``) and open every file it uses."""
    manifest = _read_manifest(src, dfd)
    if not trust:
        _authenticate(cfg, src, manifest)
    signed = not trust or _signed(cfg, src, manifest)
    rec = check_record(manifest.get("record"), memory_total=psutil.virtual_memory().total, pid_max=_pid_max())
    if rec.mounts:  # host folders to share (--mount): named only by a folder the caller trusts
        if not trust:
            raise InvalidArgument(f"{src} shares host folders: {', '.join(map(str, rec.mounts))}", hint=_TRUST_HINT)
        rec = dataclasses.replace(rec, mounts=container.check_shared(cfg, rec.mounts))
    layers = check_layers(cfg, manifest.get("layers"), rec, None if signed else _known_bases(store))
    snaps = [e for e in layers if e["role"] == "snapshot"]
    mems = check_memfiles(manifest.get("memfiles"), (e["name"] for e in snaps))
    hashes = None if trust else _check_hashes(manifest.get("files"))
    wanted = [e["archive"] for e in snaps] + [m["data"] for m in mems] + _image_files(dfd)
    if len(set(wanted)) != len(wanted):
        raise InvalidArgument(f"{src / MANIFEST} names one file for two uses")
    if hashes is not None and set(hashes) != set(wanted):
        raise InvalidArgument(f"{src} holds other files than it was saved with: "
                              f"{sorted(set(hashes) ^ set(wanted))[:5]}", hint=_TRUST_HINT)
    for rel in wanted:
        fds[rel] = _open_below(dfd, rel, str(src / rel))
    folder = _Folder(src, rec, layers, mems, hashes, fds)
    for m in mems:
        if folder.size(m["data"]) != sum(n for _, n in m["extents"]):
            raise InvalidArgument(f"memory file {m['name']}: {m['data']} does not hold exactly its extents")
    return folder


def _signed(cfg: Config, src: Path, manifest: dict[str, Any]) -> bool:
    try:
        _authenticate(cfg, src, manifest)
    except InvalidArgument:
        return False
    return True


def _known_bases(store: Store) -> frozenset[str]:
    """The folder images (base layers) this home's workspaces and snapshots stack on."""
    stacks = [w.lowers for w in store.list_workspaces()] + [s.lowers for s in rsnap_lifetime.list_all(store)]
    return frozenset(str(lowers[-1]) for lowers in stacks if lowers)


def _check_hashes(files: Any) -> dict[str, str]:
    if not isinstance(files, dict) or not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in files.values()):
        raise InvalidArgument("the saved file hashes are damaged", hint=_TRUST_HINT)
    for rel in files:
        rel_parts(rel, "hashed file")
    return files


def _image_files(dfd: int) -> list[str]:
    try:
        ifd = os.open("images", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        raise InvalidArgument(f"the snapshot folder has no images folder ({e.strerror})") from e
    try:
        names = sorted(os.listdir(ifd))
    finally:
        os.close(ifd)
    bad = [n for n in names if not _IMAGE_NAME.fullmatch(n)]
    if bad or not names:
        raise InvalidArgument(f"the snapshot's images folder holds {bad[:3] or 'no images'}",
                              hint="only CRIU images (NAME.img) belong there")
    return [f"images/{n}" for n in names]


def _open_below(dfd: int, rel: str, shown: str) -> int:
    """Open the regular file ``rel`` below ``dfd`` for reading, never following a symbolic link."""
    parts = rel_parts(rel, shown)
    fd, opened = dfd, []
    try:
        for part in parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            opened.append(fd)
        out = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC,
                      dir_fd=fd)
    except OSError as e:
        raise InvalidArgument(f"{shown} cannot be opened inside the snapshot folder without following a "
                              f"symbolic link ({e.strerror})", hint="its files must be plain files") from e
    finally:
        for f in opened:
            os.close(f)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise InvalidArgument(f"{shown} is not a regular file", hint="its files must be plain files")
    return out


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 22


def _load(cfg: Config, store: Store, folder: _Folder) -> rsnap_lifetime.SnapshotRecord:
    saved = folder.record
    old = rsnap_lifetime.update(store, saved.id, keep=True)
    if old is not None:  # loaded before (or never removed): keep that one
        return old
    base = folder.layers[-1]
    if base["role"] == "base" and not Path(base["path"]).is_dir():
        raise ImageNotFound(f"the base image {base['path']} of the saved snapshot is missing",
                            hint="put the image folder back at that path")
    lacking = [e["name"] for e in folder.layers if e["role"] == "image"
               and not cfg.paths.image_layer(e["name"]).is_dir()]
    if lacking:
        raise ImageNotFound(f"the saved snapshot stacks {len(lacking)} image layers this home lacks "
                            f"(sha256:{lacking[0][:12]}… of image {saved.image})",
                            hint=f"load or pull the image first (`bunshin image pull {saved.image}` or "
                                 "`bunshin image load FILE`): saved snapshots name image layers, not copies")
    statefs.ensure(cfg)
    todo = [e for e in folder.layers if e["role"] == "snapshot" and not cfg.paths.layer(e["name"]).is_dir()]
    mems = {e["name"]: [m for m in folder.memfiles if m["layer"] == e["name"]] for e in todo}
    _check_space(cfg, folder, todo, [m for ms in mems.values() for m in ms])
    paths = [_host_layer(cfg, e) for e in folder.layers]
    # (a live pre-copy's files are not the snapshot's own: its layer links them, the sweep frees them)
    own = [m for m in folder.memfiles if m["layer"] == saved.id and MEMFILE_NAME.fullmatch(m["name"])]
    sdir = cfg.paths.snapshot(saved.id)
    rec = dataclasses.replace(
        saved, images=str(sdir / "images"), layer=paths[0], lowers=tuple(paths[1:]), keep=True,
        memfiles=tuple(str(cfg.paths.mem / m["name"]) for m in own), owner_pid=os.getpid(),
    )
    rsnap_lifetime.claim(rec.id)
    with store.transaction():  # recorded first, as ``take`` does; unless another load was faster
        old = rsnap_lifetime.update(store, saved.id, keep=True)
        if old is not None:
            rsnap_lifetime.unclaim(rec.id)
            return old
        store.put_object(rsnap_lifetime.KIND, rec.id, rec.to_json())
    try:
        (sdir / "images").mkdir(parents=True)
        for rel in sorted(r for r in folder.fds if r.startswith("images/")):
            _copy_in(folder, rel, sdir / rel, 0o644)  # read by criu inside the clone's user namespace
        image_policy.check(sdir / "images", cfg)  # trusted or not: criu restore runs as host root
        for entry in todo:
            _extract(cfg, folder, entry, mems[entry["name"]], sdir)
        done = rsnap_lifetime.finish(store, rec, owner_pid=None)
        rsnap_lifetime.unclaim(rec.id)
        return done
    except BaseException:
        store.delete_object(rsnap_lifetime.KIND, rec.id)
        rsnap_lifetime.unclaim(rec.id)
        shutil.rmtree(sdir, ignore_errors=True)
        rsnap_sweeping.sweep(cfg, store)
        raise


def _check_space(cfg: Config, folder: _Folder, todo: list[dict[str, Any]], mems: list[dict[str, Any]]) -> None:
    """Refuse before copying when tmpfs or memory cannot hold what the folder brings."""
    tars = [folder.size(e["archive"]) for e in todo]
    need = sum(folder.size(r) for r in folder.fds if r.startswith("images/")) + sum(tars) + max(tars, default=0)
    need += sum(folder.size(m["data"]) for m in mems)
    st = os.statvfs(cfg.tmpfs)
    free, avail = st.f_bavail * st.f_frsize, psutil.virtual_memory().available
    if need > min(free, avail):
        raise ResourceExhausted(
            f"the saved snapshot needs {need >> 20} MiB; tmpfs {cfg.tmpfs} has {free >> 20} MiB free and the "
            f"host {avail >> 20} MiB of memory available",
            hint="remove snapshots or workspaces, or point BUNSHIN_TMPFS at a larger tmpfs",
        )


def _host_layer(cfg: Config, entry: dict[str, Any]) -> str:
    role = entry["role"]
    if role == "base":
        return str(entry["path"])
    if role == "mask":
        return str(images.mask_layer(cfg))
    if role == "agent":  # never from the folder: this host builds the version the images were made with
        return str(agent_bundle.AgentBundle.ensure(cfg.paths.layers).layer)
    if role == "image":
        return str(cfg.paths.image_layer(entry["name"]))
    return str(cfg.paths.layer(entry["name"]))


def _extract(cfg: Config, folder: _Folder, entry: dict[str, Any], mems: list[dict[str, Any]], sdir: Path) -> None:
    """Unpack one layer (and its memory files) under a temporary name, then rename it in place.

    The archive is copied (and hashed) into the snapshot's own folder first, and
    inspected and unpacked from that copy: the folder may change meanwhile."""
    layers_dir = cfg.paths.layers
    layers_dir.mkdir(parents=True, exist_ok=True)
    staged = sdir / f"{entry['name']}.tar"
    tmp = layers_dir / f".load-{entry['name']}-{os.urandom(4).hex()}"
    try:
        _copy_in(folder, entry["archive"], staged)
        try:
            with tarfile.open(staged, "r:") as tf:
                check_tar_members(tf, entry["name"], _workspace_ids(cfg))
        except (tarfile.TarError, EOFError) as e:
            raise InvalidArgument(f"layer {entry['name']}: {entry['archive']} is not a tar archive ({e})") from e
        tmp.mkdir()
        _run(["tar", "--extract", "--file", str(staged), "--directory", str(tmp), "--no-overwrite-dir",
              "--same-permissions", "--same-owner", *_TAR_XATTRS], f"cannot unpack layer {entry['name']}")
        staged.unlink()
        if mems:
            vfd = _make_view(tmp)
            try:
                for m in mems:
                    host = cfg.paths.mem / m["name"]
                    if not host.exists():
                        _load_memfile(folder, m, host)
                    elif precopy.LIVE_NAME.fullmatch(m["name"]):
                        _same_memfile(folder, m, host)
                    with memfile.unsealed(host):
                        os.link(host, m["name"], dst_dir_fd=vfd)
            finally:
                os.close(vfd)
        os.rename(tmp, cfg.paths.layer(entry["name"]))
    except BaseException:
        staged.unlink(missing_ok=True)
        if tmp.exists():
            rsnap_sweeping.remove_layer(tmp)
        for m in mems:  # removing the temporary links cleared the flag on the shared inode
            with contextlib.suppress(OSError):
                memfile.set_immutable(cfg.paths.mem / m["name"])
        raise


def _workspace_ids(cfg: Config) -> range | None:
    """The host ids workspaces map to (``Config.id_base``, ``id_count``); None before user namespaces."""
    base, count = getattr(cfg, "id_base", None), getattr(cfg, "id_count", None)
    return range(base, base + count) if isinstance(base, int) and isinstance(count, int) else None


def _make_view(layer: Path) -> int:
    """A descriptor of the memory-file view of an unpacked layer, made where missing and
    never reached through a symbolic link."""
    try:
        return sc.open_dir_beneath(layer, rsnap_lifetime.MEM_VIEW.strip("/").split("/"), make=True)
    except OSError as e:
        raise InvalidArgument(f"the memory-file view of layer {layer.name} is not a folder ({e.strerror})") from e


def _load_memfile(folder: _Folder, m: dict[str, Any], host: Path) -> None:
    host.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(host, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        h = hashlib.sha256()
        pos = 0
        for off, n in m["extents"]:
            _copy_range(folder.fds[m["data"]], pos, fd, off, n, h)
            pos += n
        _verify(folder, m["data"], h)
        os.ftruncate(fd, m["size"])
        os.fchmod(fd, 0o444)
    except BaseException:
        os.close(fd)
        host.unlink(missing_ok=True)
        raise
    os.close(fd)


def _same_memfile(folder: _Folder, m: dict[str, Any], host: Path) -> None:
    """Refuse unless the host's live file of that name holds exactly the saved bytes (a folder
    naming one of this home's live files would otherwise get its clones another workspace's memory)."""
    fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        same = size == m["size"] and [list(e) for e in memfile.data_extents(fd, 0, size)] == m["extents"]
        pos = 0
        for off, n in m["extents"] if same else ():
            while n > 0 and same:
                k = min(n, _CHUNK)
                same = os.pread(fd, k, off) == os.pread(folder.fds[m["data"]], k, pos)
                off, pos, n = off + k, pos + k, n - k
    finally:
        os.close(fd)
    if not same:
        raise StateConflict(f"memory file {m['name']} of the saved snapshot is in this home already with "
                            "other contents", hint="load the folder into another home (BUNSHIN_HOME)")


def _copy_in(folder: _Folder, rel: str, dst: Path, mode: int = 0o600) -> None:
    """Copy one of the folder's files to ``dst`` (new), checking its hash on the way."""
    h = hashlib.sha256()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        _copy_range(folder.fds[rel], 0, fd, 0, folder.size(rel), h)
    finally:
        os.close(fd)
    _verify(folder, rel, h)


def _verify(folder: _Folder, rel: str, h: Any) -> None:
    if folder.hashes is not None and not hmac.compare_digest(h.hexdigest(), folder.hashes[rel]):
        raise InvalidArgument(f"{folder.src / rel} was altered after it was saved", hint=_TRUST_HINT)


