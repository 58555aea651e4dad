"""A live file's one copy, shown to the process it was made for: a read-only bind mount in its mount namespace.

The live pre-copy writes the file in ``Config.paths.mem`` (host-owned, where the
clones' layers link it), and the process reaches it by the path its mappings
name (``/.bunshin/mem/<name>``) through a bind of that very file over a
host-made empty placeholder of its upper. So the parent and its clones map one
file (the clones by the layer's link, the parent by the bind) and the system
holds its memory once.

``bind`` makes the detached bind on the host (``open_tree`` of the file through
the host folder's descriptor: nothing the workspace names is followed; read-only,
nosuid, nodev) and attaches it in a child that joins the process's mount
namespace through its pidfd (a pid reused meanwhile is refused). The child reaches
the placeholder from that namespace's root one component at a time without
following a symlink, and attaches only on a host-owned (uid 0) empty regular file
in host-owned folders. The workspace cannot mount, unmount or move mounts (its
seccomp filter), nor write host-owned files. ``unbind`` removes it the same way
(unmounting by a name in the host-owned folder, from that folder, never through
``/proc``: the namespace's ``/proc`` is the workspace's pid namespace's, where the
helper has no ``self``), and refuses, changing nothing, where nothing is bound or the
process is gone (its namespace cannot be entered through its pidfd any more; another
process of the workspace's can).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from pathlib import Path

from ..kernel import syscalls as sc

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _AT_SYMLINK_NOFOLLOW = 0x1, 0x1000, 0x100
_MOVE_MOUNT_F_EMPTY_PATH, _MOVE_MOUNT_T_EMPTY_PATH = 0x4, 0x40
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MS_PRIVATE = 1 << 18
_UMOUNT_NOFOLLOW = 0x8


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class BindFailed(OSError):
    """The bind could not be made or removed (the message says where)."""


def bind(src_dir_fd: int, name: str, pidfd: int, view_dir: str) -> None:
    """Bind the file ``name`` of the host folder ``src_dir_fd`` over ``view_dir/name`` in the mount
    namespace of the process ``pidfd`` (read-only, private: nothing propagates to the host)."""
    tree = sc.syscall(_SYS_OPEN_TREE, ctypes.c_int(src_dir_fd), name.encode(),
                      ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_SYMLINK_NOFOLLOW))
    try:
        attr = _MountAttr(_MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, _MS_PRIVATE, 0)
        sc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(tree), b"", ctypes.c_uint(_AT_EMPTY_PATH),
                   ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        _in_namespace(pidfd, view_dir, name, tree)
    finally:
        os.close(tree)


def unbind(pidfd: int, view_dir: str, name: str) -> None:
    """Detach the bind ``bind`` made (lazily: mappings of the file keep it)."""
    _in_namespace(pidfd, view_dir, name, None)


def _in_namespace(pidfd: int, view_dir: str, name: str, tree: int | None) -> None:
    what = "bind" if tree is not None else "unbind"
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        raise BindFailed(f"cannot {what} the live file at {view_dir}/{name}: no helper: {exc.strerror}") from exc
    if pid == 0:  # plain syscalls only: the parent may have threads
        code = 0
        try:
            os.close(r)
            try:
                sc.setns(pidfd, sc.CLONE_NEWNS)  # (root and cwd: that namespace's root)
            except OSError as exc:
                raise OSError(exc.errno, f"its mount namespace cannot be entered: {os.strerror(exc.errno or 0)}"
                              ) from None
            _attach_or_detach(view_dir, name, tree)
        except OSError as exc:
            os.write(w, f"{exc.strerror or exc}".encode()[:1000])
            code = 1
        except BaseException:  # noqa: BLE001 (reported to the caller)
            code = 2
        finally:
            os._exit(code)
    os.close(w)
    try:
        msg = b""
        while chunk := os.read(r, 4096):
            msg += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        why = msg.decode(errors="replace") or f"its helper ended with {code}"
        raise BindFailed(f"cannot {what} the live file at {view_dir}/{name}: {why}")


def _attach_or_detach(view_dir: str, name: str, tree: int | None) -> None:
    folder = sc.open_dir_beneath("/", Path(view_dir).relative_to("/").parts, path_only=True)
    try:
        for fd in (folder,):
            st = os.fstat(fd)
            if st.st_uid != 0 or st.st_mode & 0o022:
                raise OSError(0, f"{view_dir} is not the host's")
        target = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
        try:
            st = os.fstat(target)
            if tree is None:
                os.fchdir(folder)  # (host-owned: the name cannot be swapped meanwhile)
                try:
                    sc.umount(name, sc.MNT_DETACH | _UMOUNT_NOFOLLOW)
                except OSError as exc:  # EINVAL: not a mount point (the flags are valid, nothing here is locked)
                    raise OSError(exc.errno, "nothing is bound there" if exc.errno == errno.EINVAL else exc.strerror
                                  ) from None
                return
            if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_size != 0:
                raise OSError(0, f"{view_dir}/{name} is not the host's placeholder")
            sc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(tree), b"", ctypes.c_int(target), b"",
                       ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH))
        finally:
            os.close(target)
    finally:
        os.close(folder)
