"""One layer tar into a folder of the store, safely; its digests checked on the way.

A layer tar is hostile input. What is refused (``InvalidArgument``, nothing kept):
absolute names, ``..``, names that go through a symlink or a file the layer made,
hard links to anything not already in this layer, device nodes (but ``0:0``, an
overlay whiteout), ids outside the workspaces' ``id_count``, a blob or tar whose
sha256 is not the one the manifest and the config name. Symlinks are kept with any
target: they are resolved inside the workspace's root, never on the host, since
every entry is made through descriptors of the folders walked without following
one (``O_NOFOLLOW``), and nothing is ever opened through a symlink.

OCI whiteouts become overlayfs's: ``.wh.NAME`` a character device 0:0 named NAME,
``.wh..wh..opq`` the ``trusted.overlay.opaque`` xattr on its folder. Extended
attributes in the tar are dropped (a ``trusted.overlay.*`` one would redirect the
overlay; ``security.capability`` would give a host process capabilities).

Ownership is shifted as docker's user-namespace remapping does: the tar's uid N is
stored as host uid ``id_base + N``, so root inside owns what the image's root owns,
the image's non-root users their own files, and nothing is owned by a host user.
setuid/setgid bits are kept (docker keeps them); they raise nobody: on the host the
files belong to unprivileged ids, and inside every workspace runs with no_new_privs
(as docker's ``--security-opt no-new-privileges``). A layer folder thus needs no
idmapped view.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from typing import IO, Any, cast

from ...errors import InvalidArgument, ResourceExhausted
from .caps import Budget

OPAQUE_XATTR = "trusted.overlay.opaque"
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# tarfile reads a pax header or a GNU long name whole into memory: a bomb could make it GiBs
MAX_HEADER = 1 << 20
_HEADER_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK)


class HashingReader(io.RawIOBase):
    """Reads ``inner``, hashing (sha256) and counting every byte read; more than ``limit``
    bytes (the length announced) is refused, and so is more than ``budget`` has left
    (the image's size cap, charged by the caller once the layer is whole)."""

    def __init__(self, inner: IO[bytes], limit: int | None = None, budget: Budget | None = None,
                 what: str = "the layer") -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.count = 0
        self.limit = limit
        self.budget, self.what = budget, what

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.inner.read(len(b))
        if not data:
            return 0
        n = len(data)
        if self.limit is not None and self.count + n > self.limit:
            raise InvalidArgument(f"the layer stream is longer than the {self.limit} bytes it was announced with",
                                  hint="the stream is corrupt or was replaced: fetch the layer again")
        if self.budget is not None:
            self.budget.check(self.count + n, self.what)
        b[:n] = data
        self.sha.update(data)
        self.count += n
        return n

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def compression(head: bytes) -> str | None:
    """"gzip", "zstd" or None, told by a stream's first bytes."""
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    return "zstd" if head.startswith(_ZSTD_MAGIC) else None


def decompressed(raw: Any) -> IO[bytes]:
    """``raw`` (a gzip, zstd or plain stream, told by its first bytes) decompressed."""
    buf = io.BufferedReader(raw, _CHUNK)
    kind = compression(buf.peek(4)[:4])
    if kind == "gzip":
        return cast(IO[bytes], gzip.GzipFile(fileobj=buf, mode="rb"))
    if kind == "zstd":
        import zstandard  # noqa: PLC0415 (only zstd layers need it)

        return cast(IO[bytes], zstandard.ZstdDecompressor().stream_reader(buf, read_across_frames=True))
    return buf


class _TarInfo(tarfile.TarInfo):
    """A member header whose extended headers are bounded (``MAX_HEADER``; global pax
    headers, which the tar keeps for every later member, in all) before tarfile reads them."""

    def _proc_member(self, tf: Any) -> Any:
        if self.type in _HEADER_TYPES:
            seen = self.size + (getattr(tf, "bunshin_global_bytes", 0) if self.type == tarfile.XGLTYPE else 0)
            if seen > MAX_HEADER:
                raise InvalidArgument(f"the layer's tar has an extended header of {self.size} bytes (at most "
                                      f"{MAX_HEADER} are read)", hint="the image is malformed or hostile: it is not stored")
            if self.type == tarfile.XGLTYPE:
                tf.bunshin_global_bytes = seen
        return super()._proc_member(tf)  # type: ignore[misc]  # tarfile's own hook


@dataclass(frozen=True)
class Unpacked:
    """What ``unpack`` read and wrote: the blob's and the tar's digests, bytes and entries."""

    blob_digest: str
    diff_id: str
    size_bytes: int
    entries: int


def unpack(blob: IO[bytes], dest: str, *, id_base: int, id_count: int,
           blob_digest: str | None, diff_id: str, name: str, mapped_from: int | None = None,
           limit: int | None = None, told_by: str = "the image config", budget: Budget | None = None) -> Unpacked:
    """Unpack the layer ``blob`` (compressed or not) into the empty folder ``dest``.

    ``blob_digest`` (the manifest's, None when the layer comes uncompressed from a
    docker archive) and ``diff_id`` (the config's) must match what is read. Raises
    ``InvalidArgument`` for a refused or damaged layer and ``ResourceExhausted`` when
    the disk is full; the caller removes ``dest`` then. ``mapped_from``: ids at or above
    it were written through that mapping (a build's user namespace: ``oci.build``) and
    count from it. ``limit``: bytes ``blob`` may hold at most; ``told_by``: who named
    ``diff_id`` (for the error). ``budget``: the image's size cap (``caps``), checked
    before each chunk is written (``PayloadTooLarge`` past it) and charged with the
    layer's size once it is whole.
    """
    raw = HashingReader(blob, limit)
    what = f"layer {name}"
    try:
        inner = HashingReader(decompressed(raw), budget=budget, what=what)
        writer = _Writer(dest, id_base, id_count, name, mapped_from, budget)
        try:
            with tarfile.open(fileobj=cast(IO[bytes], inner), mode="r|", errorlevel=2, tarinfo=_TarInfo) as tar:
                for member in tar:
                    writer.add(tar, member)
            inner.drain()
            raw.drain()
        finally:
            writer.close()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ResourceExhausted(f"no room to unpack layer {name} in {os.path.dirname(dest)}",
                                    hint="free disk space (`bunshin image rm`, `bunshin gc`) or move BUNSHIN_HOME") from e
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument(f"layer {name} is damaged or truncated ({e})",
                              hint="load or pull the image again from an intact copy") from e
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, ValueError) as e:
        if isinstance(e, InvalidArgument):
            raise
        raise InvalidArgument(f"layer {name} is not a valid (compressed) tar: {e}",
                              hint="load or pull the image again from an intact copy") from e
    except Exception as e:
        if type(e).__module__.startswith("zstd"):
            raise InvalidArgument(f"layer {name} is not valid zstd: {e}", hint="load or pull the image again") from e
        raise
    if blob_digest is not None and raw.digest != blob_digest:
        raise InvalidArgument(f"layer {name}: its blob's digest is {raw.digest}, the manifest says {blob_digest}",
                              hint="the blob is corrupt or was replaced: fetch the image again")
    if inner.digest != diff_id:
        raise InvalidArgument(f"layer {name}: its tar's digest is {inner.digest}, {told_by} says {diff_id}",
                              hint="the layer is corrupt or was replaced: fetch the image again")
    if budget is not None:
        budget.charge(max(inner.count, writer.bytes), what)
    return Unpacked(raw.digest, inner.digest, writer.bytes, writer.entries)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _parts(name: str, what: str, layer: str) -> list[str]:
    if name.startswith("/"):
        raise InvalidArgument(f"layer {layer}: {what} {name!r} is an absolute path",
                           hint="layer tars hold relative names only; the image is malformed or hostile")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgument(f"layer {layer}: {what} {name!r} goes up with '..'",
                           hint="layer tars hold names inside the layer only; the image is malformed or hostile")
    if any("\0" in p for p in parts):
        raise InvalidArgument(f"layer {layer}: {what} {name!r} holds a NUL byte", hint="the image is malformed")
    return parts


class _Writer:
    """Makes the members of one layer tar under ``root``, through descriptors."""

    def __init__(self, root: str, id_base: int, id_count: int, layer: str, mapped_from: int | None = None,
                 budget: Budget | None = None) -> None:
        self.root_fd = os.open(root, _DIR_FLAGS)
        self.id_base, self.id_count, self.layer = id_base, id_count, layer
        self.mapped_from, self.budget = mapped_from, budget
        self.bytes = 0
        self.entries = 0
        self.dir_times: list[tuple[list[str], int]] = []

    def close(self) -> None:
        try:
            for parts, mtime in reversed(self.dir_times):  # after their content: deepest last made first
                try:
                    fd = self._walk(parts, make=False)
                except OSError:
                    continue
                try:
                    os.utime(fd, ns=(mtime, mtime))
                finally:
                    os.close(fd)
        finally:
            os.close(self.root_fd)

    def _refuse(self, why: str) -> InvalidArgument:
        return InvalidArgument(f"layer {self.layer}: {why}", hint="the image is malformed or hostile: it is not stored")

    def _walk(self, parts: list[str], *, make: bool) -> int:
        """A descriptor of the folder ``parts`` beneath the root, made (0755, root inside)
        where missing; a symlink or a file on the way is refused."""
        fd = os.dup(self.root_fd)
        try:
            for i, part in enumerate(parts):
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not make:
                        raise
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, self.id_base, self.id_base, dir_fd=fd, follow_symlinks=False)
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self._refuse(f"{'/'.join(parts[:i + 1])!r} is not a folder of this layer "
                                           "(a symlink or a file): nothing is made through it") from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _ids(self, m: tarfile.TarInfo) -> tuple[int, int]:
        uid, gid = m.uid, m.gid
        if self.mapped_from is not None:
            uid, gid = (i - self.mapped_from if i >= self.mapped_from else i for i in (uid, gid))
        if not (0 <= uid < self.id_count and 0 <= gid < self.id_count):
            raise self._refuse(f"{m.name!r} is owned by {m.uid}:{m.gid}, outside the workspaces' "
                               f"{self.id_count} ids")
        return self.id_base + uid, self.id_base + gid

    def _clear(self, pfd: int, name: str, *, keep_dir: bool) -> bool:
        """Remove what ``name`` is in this layer (a later member replaces an earlier one);
        True if a folder was kept."""
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            if keep_dir:
                return True
            shutil.rmtree(name, dir_fd=pfd)
        else:
            os.unlink(name, dir_fd=pfd)
        return False

    def add(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _parts(m.name, "member", self.layer)
        self.entries += 1
        if not parts:
            return  # the layer's root: made by the store
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(parts)
            return
        uid, gid = self._ids(m)
        mode = m.mode & 0o7777
        pfd = self._walk(parts[:-1], make=True)
        try:
            if m.isdir():
                if not self._clear(pfd, base, keep_dir=True):
                    os.mkdir(base, 0o700, dir_fd=pfd)
                fd = os.open(base, _DIR_FLAGS, dir_fd=pfd)
                try:
                    os.fchown(fd, uid, gid)
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
                self.dir_times.append((parts, int(m.mtime) * 10**9))
                return
            self._clear(pfd, base, keep_dir=False)
            if m.isreg():
                self._file(tar, m, pfd, base, uid, gid, mode)
            elif m.issym():
                os.symlink(m.linkname, base, dir_fd=pfd)
                os.chown(base, uid, gid, dir_fd=pfd, follow_symlinks=False)
            elif m.islnk():
                self._hardlink(m, pfd, base)
                return
            elif m.isfifo():
                os.mkfifo(base, 0o600, dir_fd=pfd)
                self._own(pfd, base, uid, gid, mode)
            elif m.ischr() and m.devmajor == 0 and m.devminor == 0:
                os.mknod(base, stat.S_IFCHR, os.makedev(0, 0), dir_fd=pfd)
                os.chown(base, uid, gid, dir_fd=pfd, follow_symlinks=False)
            elif m.ischr() or m.isblk():
                raise self._refuse(f"{m.name!r} is a device node ({m.devmajor}:{m.devminor}): images may not "
                                   "bring devices")
            else:
                raise self._refuse(f"{m.name!r} is of a tar type ({m.type!r}) images do not use")
            os.utime(base, ns=(int(m.mtime) * 10**9,) * 2, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)

    def _own(self, pfd: int, base: str, uid: int, gid: int, mode: int) -> None:
        # ``base`` is what this writer just made in a folder only it writes: not a symlink.
        os.chown(base, uid, gid, dir_fd=pfd, follow_symlinks=False)
        os.chmod(base, mode, dir_fd=pfd)

    def _file(self, tar: tarfile.TarFile, m: tarfile.TarInfo, pfd: int, base: str, uid: int, gid: int,
              mode: int) -> None:
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        try:
            src = tar.extractfile(m)
            if src is not None:
                while chunk := src.read(_CHUNK):
                    if self.budget is not None:
                        self.budget.check(self.bytes + len(chunk), f"layer {self.layer}")
                    _write_all(fd, chunk)
                    self.bytes += len(chunk)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)  # after chown, which clears setuid bits
        finally:
            os.close(fd)

    def _hardlink(self, m: tarfile.TarInfo, pfd: int, base: str) -> None:
        target = _parts(m.linkname, "hard link target", self.layer)
        if not target:
            raise self._refuse(f"hard link {m.name!r} points at the layer's root")
        try:
            tfd = self._walk(target[:-1], make=False)
        except FileNotFoundError:
            raise self._refuse(f"hard link {m.name!r} points at {m.linkname!r}, which is not in this layer") from None
        try:
            st = os.stat(target[-1], dir_fd=tfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise self._refuse(f"hard link {m.name!r} points at the folder {m.linkname!r}")
            os.link(target[-1], base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            raise self._refuse(f"hard link {m.name!r} points at {m.linkname!r}, which is not in this layer") from None
        finally:
            os.close(tfd)

    def _whiteout(self, parts: list[str]) -> None:
        base = parts[-1]
        pfd = self._walk(parts[:-1], make=True)
        try:
            if base == OPAQUE_MARKER:
                os.setxattr(pfd, OPAQUE_XATTR, b"y")
                return
            if base.startswith(WHITEOUT_PREFIX * 2):
                return  # aufs metadata (.wh..wh.plnk and the like): nothing for overlayfs
            hidden = base[len(WHITEOUT_PREFIX):]
            if hidden in ("", ".", ".."):
                raise self._refuse(f"whiteout {'/'.join(parts)!r} names no entry")
            self._clear(pfd, hidden, keep_dir=False)
            os.mknod(hidden, stat.S_IFCHR, os.makedev(0, 0), dir_fd=pfd)
            os.chown(hidden, self.id_base, self.id_base, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)
