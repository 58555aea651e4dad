"""A stored layer as a tar again, to move it to a host that lacks it (``exchange``).

The store keeps a layer unpacked, not its blob, so the tar is made from the tree, the
same bytes from the same tree every time: entries in byte order of their names (a
folder before what it holds), PAX headers with whole-second times, no user or group
names, ids counted back from ``Config.id_base`` (as the image's tar had them), the
overlayfs whiteouts unpack made turned back into OCI's (a 0:0 character device ``NAME``
into ``.wh.NAME``, the ``trusted.overlay.opaque`` folder into ``.wh..wh..opq`` in it),
a file's further hard links as links to its first name, no other extended attribute
(unpack keeps none). Unpacking it (``unpack``, on any home) gives the same tree, so its
tar has the same bytes again: its sha256 is a name of the layer's content that any two
hosts agree on (cached in the store, ``LAYER_TAR_KIND``). It is not the diff id: that
names the image's own tar, whose bytes are not kept.

The tree is the store's own (root only, never written after its rename), walked
through descriptors without following a symlink. Anything unpack cannot have made
(a device, a socket, an id outside the workspaces' range, a ``.wh.`` name) is refused.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from ...config import Config
from ...errors import ImageNotFound, RuntimeFailure
from ..state.store import Store
from .records import LAYER_TAR_KIND
from .unpack import OPAQUE_MARKER, OPAQUE_XATTR, WHITEOUT_PREFIX

_CHUNK = 1 << 20
_BLOCK = 512
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class LayerTar:
    """A layer's exported tar: its sha256 (``sha256:HEX``) and length in bytes."""

    diff_id: str
    digest: str
    size: int


def _refuse(diff_id: str, path: str, why: str) -> RuntimeFailure:
    return RuntimeFailure(f"layer {diff_id[7:19]} of the image store holds {path!r}, {why}: it cannot be exported",
                          hint="the store was changed by hand: remove the image (`bunshin image rm`, "
                               "`bunshin gc`) and load it again")


class _Tar:
    """The members of one layer's tar, as bytes, from the folder's descriptor."""

    def __init__(self, cfg: Config, diff_id: str) -> None:
        self.cfg, self.diff_id = cfg, diff_id
        self.links: dict[tuple[int, int], str] = {}

    def _ids(self, st: os.stat_result, path: str) -> tuple[int, int]:
        uid, gid = st.st_uid - self.cfg.id_base, st.st_gid - self.cfg.id_base
        if not (0 <= uid < self.cfg.id_count and 0 <= gid < self.cfg.id_count):
            raise _refuse(self.diff_id, path, f"owned by {st.st_uid}:{st.st_gid}, outside the workspaces' ids")
        return uid, gid

    def _header(self, name: str, kind: bytes, st: os.stat_result | None, *, size: int = 0,
                linkname: str = "") -> bytes:
        ti = tarfile.TarInfo(name)
        ti.type, ti.size, ti.linkname = kind, size, linkname
        ti.uname = ti.gname = ""
        if st is not None:
            ti.uid, ti.gid = self._ids(st, name)
            ti.mode = st.st_mode & 0o7777
            ti.mtime = int(st.st_mtime)
        else:  # a whiteout marker: its metadata means nothing
            ti.uid = ti.gid = ti.mode = ti.mtime = 0
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def members(self, dfd: int, prefix: str) -> Iterator[bytes]:
        """Every member below the folder ``dfd`` (named ``prefix``), in order."""
        if prefix == "" and _opaque(dfd):
            yield self._header(OPAQUE_MARKER, tarfile.REGTYPE, None)
        for name in sorted(os.listdir(dfd), key=lambda n: n.encode("utf-8", "surrogateescape")):
            path = prefix + name
            if name.startswith(WHITEOUT_PREFIX):
                raise _refuse(self.diff_id, path, "a name OCI reserves for whiteouts")
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                cfd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                try:
                    yield self._header(path + "/", tarfile.DIRTYPE, os.fstat(cfd))
                    if _opaque(cfd):
                        yield self._header(f"{path}/{OPAQUE_MARKER}", tarfile.REGTYPE, None)
                    yield from self.members(cfd, path + "/")
                finally:
                    os.close(cfd)
            elif stat.S_ISREG(st.st_mode):
                yield from self._file(dfd, name, path, st)
            elif stat.S_ISLNK(st.st_mode):
                yield self._header(path, tarfile.SYMTYPE, st, linkname=os.readlink(name, dir_fd=dfd))
            elif stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                yield self._header(prefix + WHITEOUT_PREFIX + name, tarfile.REGTYPE, None)
            elif stat.S_ISFIFO(st.st_mode):
                yield self._header(path, tarfile.FIFOTYPE, st)
            else:
                raise _refuse(self.diff_id, path, f"of file type {stat.S_IFMT(st.st_mode):o}")

    def _file(self, dfd: int, name: str, path: str, st: os.stat_result) -> Iterator[bytes]:
        if st.st_nlink > 1:
            first = self.links.setdefault((st.st_dev, st.st_ino), path)
            if first != path:
                yield self._header(path, tarfile.LNKTYPE, st, linkname=first)
                return
        fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
        try:
            size = os.fstat(fd).st_size
            yield self._header(path, tarfile.REGTYPE, st, size=size)
            left = size
            while left:
                buf = os.read(fd, min(left, _CHUNK))
                if not buf:
                    raise _refuse(self.diff_id, path, "a file that shrank while it was read")
                left -= len(buf)
                yield buf
            yield b"\0" * (-size % _BLOCK)
        finally:
            os.close(fd)


def _opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise


def chunks(cfg: Config, diff_id: str) -> Iterator[bytes]:
    """The tar of the stored layer ``diff_id``, in chunks of about a MiB."""
    try:
        root = os.open(cfg.paths.image_layer(diff_id), _DIR_FLAGS)
    except FileNotFoundError:
        raise ImageNotFound(f"layer {diff_id} is not in the image store",
                            hint="`bunshin image ls` lists the images held here") from None
    try:
        buf = bytearray()
        for part in _Tar(cfg, diff_id).members(root, ""):
            buf += part
            if len(buf) >= _CHUNK:
                yield bytes(buf)
                buf.clear()
        buf += b"\0" * (2 * _BLOCK)  # the end of the archive
        yield bytes(buf)
    finally:
        os.close(root)


def describe(cfg: Config, store: Store, diff_id: str) -> LayerTar:
    """The digest and size of the stored layer's tar: made once (a pass over the tree),
    then kept in the store next to the layer's record."""
    known = store.get_object(LAYER_TAR_KIND, diff_id)
    if known is not None and cfg.paths.image_layer(diff_id).is_dir():
        digest, length = known.split()
        return LayerTar(diff_id, digest, int(length))
    h, n = hashlib.sha256(), 0
    for chunk in chunks(cfg, diff_id):
        h.update(chunk)
        n += len(chunk)
    out = LayerTar(diff_id, "sha256:" + h.hexdigest(), n)
    store.put_object(LAYER_TAR_KIND, diff_id, f"{out.digest} {out.size}")
    return out
