"""Idmapped views of host-owned layers (the base image and the mask layer), and the
host's views of folders shared on purpose (``share``).

Root inside a workspace is the host id ``Config.id_base`` (its user namespace maps
0..id_count-1 there), which has no capability over files the host owns. Seen
through a view, a file owned by host uid N shows as ``id_base + N``: root inside
owns the image's files as it would in its own machine (``pip`` into the system
Python, edits in /etc, all copied up into its upper), while nothing on the
host changes owner. A view is a read-only, nosuid, nodev bind of the layer with
``MOUNT_ATTR_IDMAP`` (Linux >= 5.12; tmpfs >= 6.3), mounted once per layer under
``Config.tmpfs/idmap`` and shared by every workspace of the config, like the layer.
nodev also means no device node an image brings can be opened inside.

Snapshot layers need no view (they are copies of what root inside wrote, already
owned by the mapped range); the agent layer keeps the host's ownership on purpose
(readable, not writable inside).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from ...config import Config
from ...errors import HostUnsupported, InvalidArgument
from ..kernel import mountinfo
from ..kernel import syscalls as sc
from ..state.records import Mount

_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_EMPTY_PATH, _AT_FDCWD = 1, 0x1000, -100
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x00100000


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def needs_view(cfg: Config, layer: Path) -> bool:
    """Host-owned layers: everything but snapshot layers, the agent layer and the layers
    of the image store (unpacked already owned by the mapped range: ``oci.unpack``)."""
    if layer.parent == cfg.paths.layers:
        return layer.name.startswith("mask-")
    return layer.parent != cfg.paths.image_layers


def view(cfg: Config, layer: Path) -> Path:
    """The idmapped view of ``layer`` (mounted on first use)."""
    digest = hashlib.sha256(str(layer).encode()).hexdigest()[:12]
    target = cfg.paths.idmap / f"{layer.name or 'root'}-{digest}"
    return _ensure(cfg, target, lambda: _mount_view(layer, target, cfg.id_base, cfg.id_count))


#: In a range's folder (``range_dir``): its views of the frozen layers and of the image store
LAYERS_VIEW, IMAGES_VIEW = "l", "i"


def range_dir(cfg: Config, host_base: int) -> Path:
    """Where the views of the workspace whose root is ``host_base`` are mounted (``range_views``)."""
    return cfg.paths.idmap / f"r{(host_base - cfg.id_base) // cfg.id_count}"


# A workspace's overlay line in /proc/PID/mountinfo must stay short: CRIU cannot parse
# a longer one ("Bad format in mountinfo"), and mount(2) takes one page of options.
STACK_OPTIONS_MAX = 2000


def collapse(cfg: Config, lowers: list[str], host_base: int | None = None) -> list[str]:
    """``lowers`` (top first, views already applied) with the run of image-store layers
    at their bottom replaced by one read-only overlay of them (``stack``) when the list
    would be too long for CRIU; nothing is copied. With ``host_base`` the layers are a
    range's views and the stack is that range's (``range_dir``)."""
    if len(":".join(lowers)) <= STACK_OPTIONS_MAX:
        return lowers
    where = None if host_base is None else range_dir(cfg, host_base)
    run = image_run(cfg, lowers, None if where is None else where / IMAGES_VIEW)
    if len(run) < 2:
        return lowers
    return [*lowers[:len(lowers) - len(run)], str(stack(cfg, run, where))]


def image_run(cfg: Config, lowers: Sequence[str], folder: Path | None = None) -> list[str]:
    """The image-store layers at the bottom of ``lowers`` (top first): in ``folder`` (a
    range's view of the store), by default in the store itself."""
    folder = folder or cfg.paths.image_layers
    n = 0
    while n < len(lowers) and Path(lowers[len(lowers) - 1 - n]).parent == folder:
        n += 1
    return list(lowers[len(lowers) - n:])


def stack_target(cfg: Config, layers: list[str], where: Path | None = None) -> Path:
    # the options are part of the name: a stack mounted without nfs_export is not reused
    digest = hashlib.sha256("\n".join(["nfs_export", *layers]).encode()).hexdigest()[:16]
    return (where or cfg.paths.idmap) / f"stack-{digest}"


def stack(cfg: Config, layers: list[str], where: Path | None = None) -> Path:
    """A read-only, nodev overlay of the image-store ``layers`` (top first), mounted once
    and shared like the views: a deep image becomes one lower of a workspace's overlay
    (overlay over overlay, the kernel's stacking depth of 2). It decodes its file handles
    (``nfs_export``, which a read-only overlay allows with ``redirect_dir=nofollow``;
    image layers bring no redirects), else the workspace's overlay could not either
    (``container.EXPORT_OPTIONS``)."""
    target = stack_target(cfg, layers, where)
    return _ensure(cfg, target, lambda: sc.mount_overlay_fs(
        str(target), layers, attrs=sc.MOUNT_ATTR_RDONLY | sc.MOUNT_ATTR_NODEV,
        options=(("redirect_dir", "nofollow"), ("nfs_export", "on"))))


def release_stacks(cfg: Config, keep: set[Path]) -> list[str]:
    """Unmount the image stacks but ``keep``; what was unmounted."""
    out = []
    for target in mounted(cfg):
        if Path(target).name.startswith("stack-") and Path(target) not in keep:
            try:
                sc.umount(target, sc.MNT_DETACH)
                os.rmdir(target)
            except OSError:
                continue
            out.append(target)
    return out


def share(cfg: Config, mount: Mount) -> Path:
    """The host's view of a folder shared on purpose (``--mount``), mounted on first use.

    Read-only: idmapped like a layer (its files owned inside as on the host), read-only,
    nosuid, nodev. Read-write: a plain nosuid, nodev bind, not idmapped: what the
    workspace creates there belongs to host uid ``id_base`` (never host root), the
    host's files show as nobody inside. Workspaces (and the CRIU restore of a clone)
    bind this view, never the host path: the folder is opened once, here, walking
    ``mount.host`` without following a symlink.
    """
    kind = "ro" if mount.read_only else "rw"
    digest = hashlib.sha256(f"{kind}:{mount.host}".encode()).hexdigest()[:12]
    target = cfg.paths.idmap / f"share-{kind}-{Path(mount.host).name or 'root'}-{digest}"
    return _ensure(cfg, target, lambda: _mount_view(Path(mount.host), target, cfg.id_base, cfg.id_count,
                                                     idmapped=mount.read_only, walk=True))


def _mount_id(path: Path) -> int | None:
    """The id of the mount ``path`` lies on (a last component that is a symlink is not followed)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    return int(line.split()[1])
    finally:
        os.close(fd)
    return None


def is_mounted(target: Path) -> bool:
    """Whether something is mounted at the view folder ``target``: its mount is not its
    folder's. Two small reads, where ``mounted`` parses all of mountinfo, which grows
    with every clone (two reads per restore took ~70 ms at 1,024 clones)."""
    own, parent = _mount_id(target), _mount_id(target.parent)
    return own is not None and parent is not None and own != parent


def _ensure(cfg: Config, target: Path, mount: Callable[[], None]) -> Path:
    if is_mounted(target):
        return target
    cfg.paths.idmap.mkdir(parents=True, exist_ok=True)
    lock = os.open(cfg.paths.idmap, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one mount per view, whoever asks first
        if os.path.realpath(target) not in mounted(cfg):
            target.mkdir(exist_ok=True)
            mount()
    finally:
        os.close(lock)
    return target


def mounted(cfg: Config) -> set[str]:
    """The views mounted now (bunshin's own state, like its tmpfs)."""
    # From mountinfo: a view of a layer on bunshin's tmpfs is a bind within the same
    # filesystem, which ``os.path.ismount`` does not see.
    base = os.path.realpath(cfg.paths.idmap) + "/"
    return {t for t in mountinfo.below(base) if "/" not in t[len(base):]}


def release(cfg: Config) -> None:
    """Unmount every view (they are rebuilt on next use)."""
    for target in mounted(cfg):
        try:
            sc.umount(target, sc.MNT_DETACH)
        except OSError:
            pass


def probe(cfg: Config, layer: Path = Path("/")) -> None:
    """Make a view of ``layer`` without attaching it anywhere (``doctor``); raises
    HostUnsupported if this host cannot."""
    _mount_view(layer, None, cfg.id_base, cfg.id_count)


def host_map(base: int, count: int) -> str:
    """The id map of a view of a host-owned layer: host ids 0.. show as ``base``.."""
    return f"0 {base} {count}\n"


def _mount_view(layer: Path, target: Path | None, base: int, count: int, *,
                idmapped: bool = True, walk: bool = False, maps: str | None = None) -> None:
    """``idmapped``: mapped to base.. (or by the uid/gid map ``maps``) and read-only; else a
    plain bind. Always nosuid, nodev. ``walk``: ``layer`` is reached without following
    symlinks. ``maps`` views are writable (a workspace's upper)."""
    userns = -1
    try:
        if idmapped:
            userns = userns_fd(maps or host_map(base, count))
        attach_view(layer, target, userns, read_only=maps is None, walk=walk)
    finally:
        if userns >= 0:
            os.close(userns)


def attach_view(layer: Path, target: Path | None, userns: int, *, read_only: bool = True,
                walk: bool = False) -> None:
    """A nosuid, nodev bind of ``layer`` at ``target`` (None: made and dropped, ``probe``),
    idmapped by the user namespace ``userns`` (-1: not idmapped); read-only if asked."""
    idmapped = userns >= 0
    tree = src = -1
    try:
        if walk:
            src = sc.open_dir_beneath("/", layer.relative_to("/").parts, path_only=True)
        tree = sc.syscall(_SYS_OPEN_TREE, ctypes.c_int(src if walk else _AT_FDCWD), b"" if walk else str(layer).encode(),
                        ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | (_AT_EMPTY_PATH if walk else 0)))
        flags = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if idmapped and read_only else 0)
        attr = (_MountAttr(flags | _MOUNT_ATTR_IDMAP, 0, 0, userns) if idmapped
                else _MountAttr(flags, 0, 0, 0))
        sc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(tree), b"", ctypes.c_uint(_AT_EMPTY_PATH),
                 ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        if target is not None:
            sc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(tree), b"", ctypes.c_int(_AT_FDCWD),
                     str(target).encode(), ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH))
    except OSError as e:
        if walk and e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise InvalidArgument(f"cannot share {layer}: {e.strerror} on its path",
                                  hint="a shared folder is reached without following symlinks") from e
        raise HostUnsupported(
            f"cannot make {'an idmapped' if idmapped else 'a'} view of {layer}: {e.strerror}",
            hint="workspaces need idmapped mounts (Linux >= 5.12; tmpfs >= 6.3) on the image's filesystem",
        ) from e
    finally:
        for fd in (tree, src):
            if fd >= 0:
                os.close(fd)


def userns_fds(maps: Sequence[str]) -> list[int]:
    """Fds of user namespaces, one per uid/gid map in ``maps`` (held by no process)."""
    out: list[int] = []
    try:
        for m in maps:
            out.append(userns_fd(m))
    except BaseException:
        for fd in out:
            os.close(fd)
        raise
    return out


_CLONE_VM = 0x100


class _SigSet(ctypes.Structure):  # glibc's sigset_t (signal's own wrapper turns a mask into ~60 enums: 0.2 ms)
    _fields_ = [("bits", ctypes.c_ulong * 16)]


_ALL_SIGNALS = _SigSet((ctypes.c_ulong * 16)(*([~0 & 0xFFFFFFFFFFFFFFFF] * 16)))
_SYS_PAUSE = 34  # x86_64
_STACK = 64 << 10
#: The name (``comm``) of ``userns_fd``'s child: a child its maker did not kill (it was
#: killed first: ``kill -9`` of a forker) pauses forever holding the dead maker's memory;
#: ``orphaned_helpers`` finds it by this name.
HELPER_NAME = b"bunshin-userns"
_PR_SET_NAME, _PR_GET_NAME = 15, 16
_SYS_KCMP, _KCMP_VM = 312, 1  # x86_64


def userns_fd(maps: str) -> int:
    """An fd of a user namespace whose uid and gid maps are ``maps`` (held by no process).

    Made by a child cloned with ``CLONE_NEWUSER | CLONE_VM``: it shares this process's
    memory (no page table is copied: 0.15-0.2 ms whatever this process holds, where a
    fork took 9 ms of a small Python process and 52 ms of one holding 400 MiB) and runs
    only libc's ``syscall(SYS_pause)`` on a stack of its own, every signal blocked, until
    it is killed once its namespace is mapped and opened."""
    stack = ctypes.create_string_buffer(_STACK)
    top = ctypes.c_void_p((ctypes.addressof(stack) + _STACK - 64) & ~15)
    entry = ctypes.cast(_libc.syscall, ctypes.c_void_p)
    old = _SigSet()
    own_name = ctypes.create_string_buffer(16)
    _libc.prctl(_PR_GET_NAME, own_name, 0, 0, 0)
    _libc.prctl(_PR_SET_NAME, HELPER_NAME, 0, 0, 0)  # the child takes the thread's name
    _libc.pthread_sigmask(signal.SIG_BLOCK, ctypes.byref(_ALL_SIGNALS), ctypes.byref(old))  # the child's: SIGKILL only
    try:
        pid = _clone(entry, top, _CLONE_VM | sc.CLONE_NEWUSER | signal.SIGCHLD, ctypes.c_void_p(_SYS_PAUSE))
        err = ctypes.get_errno()
    finally:
        _libc.pthread_sigmask(signal.SIG_SETMASK, ctypes.byref(old), None)
        _libc.prctl(_PR_SET_NAME, own_name, 0, 0, 0)
    if pid < 0:
        raise OSError(err, f"clone(CLONE_NEWUSER): {os.strerror(err)}")
    try:
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(maps)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        del stack  # (kept alive until the child is gone)


_libc = ctypes.CDLL(None, use_errno=True)
_clone = _libc.clone
_clone.restype = ctypes.c_int
_clone.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]


def orphaned_helpers() -> list[int]:
    """``userns_fd`` children whose maker died before killing them: named ``HELPER_NAME``,
    in this process's pid namespace (a workspace's process may take the name, but not leave
    its namespace), and no longer sharing their parent's memory (``kcmp(KCMP_VM)``: a live
    maker's child always does; an orphan's parent is init or a subreaper)."""
    return [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == HELPER_NAME.decode()
            and _is_orphan(p.pid)]


def kill_orphaned_helpers() -> list[int]:
    """SIGKILL every ``orphaned_helpers`` process, each through a pidfd taken before it is
    checked again (a pid reused in between is never signalled); the pids killed."""
    killed = []
    for pid in orphaned_helpers():
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            if _is_orphan(pid):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed.append(pid)
        except OSError:
            pass
        finally:
            os.close(fd)
    return killed


def _is_orphan(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        if proc.name() != HELPER_NAME.decode():
            return False
        if os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid"):
            return False
        return bool(_libc.syscall(_SYS_KCMP, pid, proc.ppid(), _KCMP_VM, 0, 0) != 0)
    except (psutil.Error, OSError):
        return False
