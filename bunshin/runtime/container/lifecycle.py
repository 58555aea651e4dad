"""Workspace containers on the host: create, inspect, destroy.

A container is an overlay root (image layers + the agent layer + a private upper on
tmpfs), a cgroup with memory and pids limits, and pid/mount/uts/ipc/net namespaces
whose pid 1 is the in-workspace agent. Everything created is recorded in the store
*before* it is created, so a crash at any point leaves something ``gc`` can find.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from ...config import DEFAULT_HOME, INSTALL_DIR, Config
from ...errors import BunshinError, InvalidArgument, RuntimeFailure
from ..agent_host.bundle import AgentBundle
from ..agent_host.client import AgentClient
from ..kernel import mountinfo
from ..kernel import syscalls as sc
from ..net import attach as net
from ..net.policy import NetworkMode, Policy
from ..state import budget, idranges
from ..state.records import Mount, WorkspaceRecord, WorkspaceState, check_mounts
from ..state.store import Store
from . import idmap, range_views, statefs, teardown
from .cgroups import Layout, WorkspaceCgroup, parse_size
from .images import resolve as resolve_image

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
READY_TIMEOUT_S = 20.0


#: What :func:`new_id` makes.
ID_RE = re.compile(r"ws-[0-9a-f]{12}")


def new_id() -> str:
    return "ws-" + secrets.token_hex(6)


def upper_size(memory_limit: int | None) -> int | None:
    """The size of a workspace's upper: half its memory limit (its files are memory,
    charged to it: a workspace that fills /tmp gets ENOSPC while its agent and its
    processes still have room), None (half the host's memory) without a limit."""
    return None if memory_limit is None else max(memory_limit // 2, 16 << 20)


def make_workspace_dir(rec: WorkspaceRecord, owner: int) -> None:
    """The workspace's folder, a tmpfs of ``upper_size`` holding its upper (owned by
    ``owner``, root inside: the overlay's root takes the upper's owner), the overlay's
    work folder and the root mount point."""
    wdir = Path(rec.upper).parent
    wdir.mkdir(parents=True)
    size = upper_size(rec.memory_limit)
    opts = "mode=0755" + (f",size={size}" if size is not None else "")
    try:
        sc.mount("bunshin-upper", str(wdir), "tmpfs", sc.MS_NOSUID | sc.MS_NODEV, opts)
    except OSError as e:
        raise RuntimeFailure(f"cannot mount the upper tmpfs of {rec.id}: {e}") from e
    for d in (rec.upper, rec.work, rec.root):
        os.mkdir(d)
    os.chown(rec.upper, owner, owner)


def host_ids(cfg: Config, rec: WorkspaceRecord) -> int:
    """The host uid (and gid) of root inside ``rec``: the first id of its range."""
    return cfg.id_base if rec.ids is None else rec.ids


def socket_path(rec: WorkspaceRecord) -> Path:
    return Path(rec.root) / AgentBundle.SOCKET.lstrip("/")


def agent(rec: WorkspaceRecord) -> AgentClient:
    """A client of the workspace's agent, sharing the workspace's call lock (see ``quiesced``).

    The socket's folder is the workspace's to write: the client walks to it from the
    mounted root without following symlinks and talks only to a socket the
    workspace's pid 1 (the agent) listens on (``AgentClient._connect``).
    """
    return AgentClient(socket_path(rec), lock_dir=Path(rec.root).parent, beneath=Path(rec.root),
                       expect_pid=rec.pid)


def publish_identity(rec: WorkspaceRecord, identity: dict[str, Any]) -> None:
    """Write who the workspace is (``identity.json``, ``fork-id``) where its agent and
    processes read it, through the mounted root: a clone gets it before it is
    restored, without a call into its agent (a first call costs a Python agent
    ~2 MiB of copy-on-write).

    The folders are walked one at a time without following symlinks: a workspace
    owns its files, and a symlink it left at /run/bunshin must not send the host's
    write anywhere else (whatever is not a folder on that path is replaced by one).
    """
    files = {"identity.json": json.dumps(identity) + "\n"}
    if identity.get("fork_id") is not None:
        files["fork-id"] = f"{identity['fork_id']}\n"
    dir_fd = os.open(rec.root, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    owner = os.fstat(dir_fd).st_uid  # root inside: folders made here are its own
    try:
        for part in Path(AgentBundle.RUN_DIR).relative_to("/").parts:
            try:
                child = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            except FileNotFoundError:
                os.mkdir(part, 0o755, dir_fd=dir_fd)
                child = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                os.fchown(child, owner, owner)
            except OSError as e:
                if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                os.unlink(part, dir_fd=dir_fd)  # a symlink or file of the workspace's: not followed
                os.mkdir(part, 0o755, dir_fd=dir_fd)
                child = os.open(part, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                os.fchown(child, owner, owner)
            os.close(dir_fd)
            dir_fd = child
        for name, text in files.items():
            tmp = f".{name}.tmp{os.getpid()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=dir_fd)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def check_shared(cfg: Config, mounts: Sequence[Mount | str]) -> tuple[Mount, ...]:
    """``mounts`` checked (``records.check_mounts``), none holding or inside bunshin's own state."""
    if isinstance(mounts, str | Mount):
        mounts = [mounts]
    out = check_mounts(mounts)
    own = [cfg.home.resolve(), Path(os.path.realpath(cfg.tmpfs)), DEFAULT_HOME, INSTALL_DIR]
    for m in out:
        host = Path(m.host)
        if any(host.is_relative_to(p) or p.is_relative_to(host) for p in own):
            raise InvalidArgument(f"mount host folder {host} holds or lies in bunshin's own state",
                                  hint="share a folder outside " + ", ".join(map(str, own)))
    return out


def validate_name(name: str | None) -> None:
    if name is not None and not _NAME.match(name):
        raise InvalidArgument(
            f"invalid workspace name {name!r}",
            hint="use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )


def create(
    cfg: Config,
    store: Store,
    *,
    image: str = "host",
    name: str | None = None,
    memory: str | int | None = "2G",
    pids: int | None = 512,
    command: list[str] | None = None,
    mounts: Sequence[Mount | str] = (),
    network: NetworkMode | str = NetworkMode.NONE,
    policy: Policy | None = None,
) -> WorkspaceRecord:
    """Create and start a workspace; returns its record in state RUNNING.

    ``network``: ``none`` (loopback only) or ``egress`` (an address, a route and NAT out,
    under ``policy``: ``runtime.net``); a policy without egress is refused.

    ``mounts``: host folders shared on purpose (``Mount``, or ``HOST:PATH[:ro|rw]``).
    ``image``: 'host', a root filesystem folder or a stored (or pullable) image reference;
    an image's Env, WorkingDir and User apply to every command, and ``command`` runs
    as ``docker run IMAGE [command]`` would (its Entrypoint, then ``command`` or Cmd)."""
    validate_name(name)
    mode = NetworkMode.of(network)
    if policy is not None and mode != NetworkMode.EGRESS:
        raise InvalidArgument("allow/deny rules need network='egress'", hint="pass network='egress' (--network egress)")
    shared = check_shared(cfg, mounts)
    mem_bytes = parse_size(memory)
    pids = budget.check_pids_limit(pids)
    statefs.ensure(cfg)
    base = resolve_image(cfg, store, image)
    lowers = base.lowers
    if base.config is not None:
        command = base.config.command(command) or None
    bundle = AgentBundle.ensure(cfg.paths.layers)
    layout = Layout.discover()
    ws_id = new_id()
    wdir = cfg.paths.workspace(ws_id)
    ids = idranges.reserve(cfg, store, ws_id)
    rec = WorkspaceRecord(
        id=ws_id,
        name=name,
        image=image,
        state=WorkspaceState.CREATING,
        created_at=time.time(),
        root=str(wdir / "root"),
        upper=str(wdir / "upper"),
        work=str(wdir / "work"),
        lowers=tuple(str(p) for p in [bundle.layer, *lowers]),
        cgroup_version=layout.version,
        cgroups=WorkspaceCgroup.of(layout, cfg.cgroup_prefix + ws_id).dirs_as_str(),
        memory_limit=mem_bytes,
        pids_limit=pids,
        hostname=name or ws_id,
        owner_pid=os.getpid(),
        command=tuple(command) if command else None,
        mounts=shared,
        extra={"image_id": base.image_id, "image_config": base.config.agent_defaults()} if base.config else {},
        ids=ids,
        network=mode.value,
    )
    try:
        budget.add_within(store, rec)  # refused here (nothing made) if the host's pids budget is spent
    except BaseException:
        idranges.free(cfg, store, ids)
        raise
    try:
        make_workspace_dir(rec, cfg.id_base)
        prepare_upper(Path(rec.upper), cfg.id_base)
        if base.config is not None and base.config.user:
            _shared_run_dir(Path(rec.upper), cfg.id_base)
        mount_overlay(rec, cfg)
        cg = WorkspaceCgroup.create(layout, cfg.cgroup_prefix + ws_id, memory=mem_bytes, pids=pids)
        pid = _launch(cfg, rec, cg, bundle)
        started = {"state": WorkspaceState.RUNNING, "pid": pid, "pid_start": psutil.Process(pid).create_time(),
                   "owner_pid": None}
        rec = store.update_workspace(ws_id, lambda r: r.replace(**started)) or rec.replace(**started)
        if mode == NetworkMode.EGRESS:
            net.connect(cfg, store, ws_id, pid, policy or Policy())
        client = agent(rec)
        try:
            client.wait_ready(READY_TIMEOUT_S)
        except BunshinError as e:
            raise RuntimeFailure(f"the workspace agent did not start: {e}\n{agent_log_tail(rec)}") from e
        if command:
            client.spawn(argv=list(command))
        return rec
    except BaseException:
        destroy(cfg, store, rec)
        raise


_DEVICES = {  # name: (major, minor)
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
_DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
              "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}


def prepare_upper(upper: Path, owner: int) -> None:
    """Lay out a new workspace's (still empty, host-made) upper before its first mount.

    Root inside is the host id ``owner``, which has no capability over host-owned
    files: the folders it must write (/tmp, /run, /root, /dev, /.bunshin/run; / is given
    by ``make_workspace_dir``) are made here and given to it, and /dev's nodes are made here, since nothing inside
    a user namespace may mknod. /.bunshin itself stays the host's.
    """
    def make(rel: str, mode: int, uid: int = owner) -> Path:
        path = upper / rel
        path.mkdir(mode=mode)
        os.chmod(path, mode)
        os.chown(path, uid, uid)
        return path

    make(".bunshin", 0o755, uid=0)
    make(".bunshin/run", 0o755)
    for rel, mode in (("tmp", 0o1777), ("run", 0o755), ("root", 0o700), ("dev", 0o755),
                      ("dev/pts", 0o755), ("dev/shm", 0o1777)):
        make(rel, mode)
    for name, (major, minor) in _DEVICES.items():
        os.mknod(upper / "dev" / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(upper / "dev" / name, 0o666)
        os.chown(upper / "dev" / name, owner, owner)
    for name, target in _DEV_LINKS.items():
        os.symlink(target, upper / "dev" / name)
        os.lchown(upper / "dev" / name, owner, owner)


_MOUNT_OPTIONS_MAX = 4000  # mount(2) takes one page of options


# Folders under /run the tools make as the exec user: for an image whose User is not
# root, made here writable by every user (sticky, as /tmp), since /run is root's.
SHARED_RUN_DIRS = ("run/bunshin-tools",)


def _shared_run_dir(upper: Path, owner: int) -> None:
    for rel in SHARED_RUN_DIRS:
        path = upper / rel
        path.mkdir(mode=0o1777)
        os.chmod(path, 0o1777)
        os.chown(path, owner, owner)


# The overlay decodes its own file handles (``index=on,nfs_export=on``): CRIU dumps an
# inotify watch by the path its handle decodes to (read back from the opened handle),
# and a restore watches that path in the clone's own overlay, so the watch fires on
# the clone's changes only. Without them CRIU refuses every watch on the root
# ("fsnotify: Can't dump that handle"). A lower that cannot decode handles makes the
# kernel fall back to both off (mountinfo then lacks them, and a fork with a watch on
# it is refused by name: ``unforkable``).
EXPORT_OPTIONS = (("index", "on"), ("nfs_export", "on"))


def mount_overlay(rec: WorkspaceRecord, cfg: Config) -> None:
    """Mount ``rec``'s overlay root (``EXPORT_OPTIONS``); its layers and upper are seen
    through views idmapped to its range (``range_views``; older records: host-owned
    layers through ``idmap``'s views to ``Config.id_base``)."""
    upper, work = rec.upper, rec.work
    if rec.ids is None:
        lowers = idmap.collapse(cfg, [str(idmap.view(cfg, Path(p)) if idmap.needs_view(cfg, Path(p)) else p)
                                      for p in rec.lowers])
    else:
        lowers, view = range_views.overlay(cfg, rec.ids, rec.lowers, Path(rec.upper).parent)
        upper, work = str(view / Path(rec.upper).name), str(view / Path(rec.work).name)
    opts = f"lowerdir={':'.join(lowers)},upperdir={upper},workdir={work}"
    opts += "".join(f",{k}={v}" for k, v in EXPORT_OPTIONS)
    if len(lowers) > sc.OVERLAY_MAX_LOWERS:
        raise InvalidArgument(f"layer stack of {len(rec.lowers)} layers is deeper than overlayfs's "
                              f"{sc.OVERLAY_MAX_LOWERS}", hint="fork from a shallower snapshot or a fresh workspace")
    try:
        if len(opts) > _MOUNT_OPTIONS_MAX or any("," in p or ":" in p for p in lowers):
            sc.mount_overlay_fs(rec.root, lowers, upper, work,  # one layer per call, no page limit
                                options=EXPORT_OPTIONS)
        else:
            sc.mount("overlay", rec.root, "overlay", 0, opts)
    except OSError as e:
        raise RuntimeFailure(f"cannot mount the overlay root of {rec.id}: {e}") from e


def _launch(cfg: Config, rec: WorkspaceRecord, cg: WorkspaceCgroup, bundle: AgentBundle) -> int:
    spec = {
        "root": rec.root,
        "hostname": rec.hostname,
        "cgroup_procs": [str(p / "cgroup.procs") for p in cg.paths],
        "argv": bundle.argv,
        "env": {**bundle.env, **({"BUNSHIN_IMAGE": json.dumps(rec.extra["image_config"])}
                                  if "image_config" in rec.extra else {})},
        "log": AgentBundle.LOG,
        "ids": [host_ids(cfg, rec), cfg.id_count],
        "mounts": [{"source": str(share_view(cfg, rec, m)), "path": m.path} for m in rec.mounts],
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "bunshin.runtime.container.init"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        close_fds=True,
        start_new_session=True,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    try:
        out, err = proc.communicate(json.dumps(spec).encode(), timeout=READY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeFailure(f"the workspace launcher of {rec.id} hung") from None
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0 or text or not out.strip():
        raise RuntimeFailure(f"cannot start workspace {rec.id}: {text or 'launcher exited ' + str(proc.returncode)}")
    return int(out.split()[0])


def share_view(cfg: Config, rec: WorkspaceRecord, mount: Mount) -> Path:
    """The host's view of the shared folder ``mount`` for ``rec`` (its range's, ``range_views.share``)."""
    return idmap.share(cfg, mount) if rec.ids is None else range_views.share(cfg, rec.ids, mount)


_LOG_TAIL_BYTES = 64 * 1024


def agent_log_tail(rec: WorkspaceRecord, lines: int = 20) -> str:
    """The last ``lines`` of the agent's log, read from the upper without following
    anything the workspace put on its path (it must be a regular file; at most the
    last 64 KiB are read)."""
    from ..memfile.fileio import open_in_root  # noqa: PLC0415 (container's imports are not this function's)

    fd = open_in_root(Path(rec.upper), AgentBundle.LOG)
    if fd is None:
        return "(no agent log)"
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, _LOG_TAIL_BYTES, max(size - _LOG_TAIL_BYTES, 0))
    except OSError:
        return "(no agent log)"
    finally:
        os.close(fd)
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def is_alive(rec: WorkspaceRecord) -> bool:
    """Is the workspace's pid 1 still the process we started?"""
    if rec.pid is None:
        return False
    try:
        proc = psutil.Process(rec.pid)
        return abs(proc.create_time() - (rec.pid_start or 0)) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_mounted(path: str) -> bool:
    return mountinfo.at(path) is not None


def _removing(rec: WorkspaceRecord) -> WorkspaceRecord:
    return rec if rec.state == WorkspaceState.REMOVING else rec.replace(state=WorkspaceState.REMOVING)


def destroy(cfg: Config, store: Store, rec: WorkspaceRecord) -> None:
    """Kill every process, unmount, remove cgroups, files and the record. Idempotent."""
    if rec.state != WorkspaceState.REMOVING:
        rec = store.update_workspace(rec.id, _removing) or _removing(rec)
    cg = WorkspaceCgroup.of_record(rec)
    if is_alive(rec) and rec.pid is not None:
        try:
            os.kill(rec.pid, 9)
        except ProcessLookupError:
            pass
    cg.kill_all()
    wdir = cfg.paths.workspace(rec.id)
    for mount_point in (rec.root, str(wdir)):
        teardown.umount_all(mount_point)  # no mountinfo read: it grows with every clone
    shutil.rmtree(wdir, ignore_errors=True)
    cg.destroy()
    if rec.network != NetworkMode.NONE:
        net.disconnect(cfg, store, rec.id)
    if rec.ids is not None:
        range_views.release(cfg, rec.ids)
    store.delete_workspace(rec.id)
    idranges.free(cfg, store, rec.ids)
