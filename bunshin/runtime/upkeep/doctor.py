"""Host checks: can this machine run bunshin workspaces, and what to do if not."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...config import Config
from .. import snapshot
from ..container import cgroup_moves, idmap, init, seccomp, statefs
from ..container.cgroups import Layout
from ..criu import kdat as criu_kdat
from ..criu import run as criu
from ..kernel import host_limits, mountinfo

MIN_CRIU = (4, 2)
# What a check finds: passed, what it saw, how to fix it (None when it passed).
Result = tuple[bool, str, str | None]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    required: bool = True  # a failed required check means workspaces cannot work


def _check(name: str, fn: Callable[[], Result], *, required: bool = True) -> Check:
    try:
        ok, detail, fix = fn()
    except Exception as e:  # a check must never crash doctor
        ok, detail, fix = False, f"{type(e).__name__}: {e}", None
    return Check(name, ok, detail, fix, required)


def _root() -> Result:
    ok = os.geteuid() == 0
    return ok, f"euid {os.geteuid()}", None if ok else "run bunshin as root (sudo)"


def _kernel() -> Result:
    rel = platform.release()
    major, minor = (int(x) for x in rel.split(".")[:2])
    ok = (major, minor) >= (5, 10)
    return ok, rel, None if ok else "use a Linux kernel >= 5.10"


def _overlay() -> Result:
    ok = "overlay" in Path("/proc/filesystems").read_text()
    return ok, "overlay in /proc/filesystems" if ok else "overlayfs missing", None if ok else "modprobe overlay"


def _namespaces() -> Result:
    kinds = ["pid", "mnt", "uts", "ipc", "net"]
    missing = [k for k in kinds if not Path(f"/proc/self/ns/{k}").exists()]
    return not missing, "pid, mnt, uts, ipc, net" if not missing else f"missing: {missing}", (
        "use a kernel built with namespaces" if missing else None
    )


def _cgroups() -> Result:
    layout = Layout.discover()
    ctrls = sorted({c for h in layout.hierarchies for c in h.controllers})
    need = {"memory", "pids"}
    ok = need <= set(ctrls)
    base = ", ".join(f"{c}:{h.base}" for h in layout.hierarchies for c in h.controllers)
    return ok, f"v{layout.version}: {base}", None if ok else "enable the memory and pids controllers"


def _tmpfs(cfg: Config) -> Result:
    cfg.tmpfs.mkdir(parents=True, exist_ok=True)
    fstype = mountinfo.fs_type_of(cfg.tmpfs)
    st = os.statvfs(cfg.tmpfs)
    free = st.f_bavail * st.f_frsize
    ok = fstype == "tmpfs"
    return ok, f"{cfg.tmpfs} on {fstype}, {free / 2**30:.1f} GiB free", (
        None if ok else "set BUNSHIN_TMPFS to a folder on a tmpfs (e.g. /dev/shm/bunshin)"
    )


def _huge_pages(cfg: Config) -> Result:
    """bunshin's tmpfs has (or will get) huge pages: short fork pauses, small page tables."""
    opts, images = statefs.options(cfg.tmpfs), statefs.options(statefs.images_root(cfg))
    if opts is not None:
        ok = statefs.ADVISE in opts and statefs.WITHIN_SIZE in (images or "")
        detail = f"{cfg.tmpfs}: {opts}; images: {images or 'not a mount'}"
    elif cfg.tmpfs.is_dir() and any(cfg.tmpfs.iterdir()):
        ok, detail = False, f"{cfg.tmpfs} is a non-empty folder: used as it is, without huge pages"
    else:
        return True, f"{cfg.tmpfs} gets its own tmpfs ({statefs.ADVISE}, images {statefs.WITHIN_SIZE}) on first use", None
    fix = ("with nothing running, `bunshin gc` then remove the folder (it is remounted on next use), "
           "or point BUNSHIN_TMPFS at a new path")
    return ok, detail, None if ok else fix


def _criu(cfg: Config) -> Result:
    fix = "run `make install` (installs CRIU >= 4.2 into /opt/bunshin/criu) or set BUNSHIN_CRIU"
    if not cfg.criu.exists() and not shutil.which(str(cfg.criu)):
        return False, f"{cfg.criu} not found", fix
    text = criu.version(cfg.criu)
    ver = tuple(int(x) for x in text.split(".") if x.isdigit())
    if ver < MIN_CRIU:
        return False, f"{cfg.criu}: version {text} < 4.2", fix
    ok, output = criu.check(cfg.criu)
    lines = [ln for ln in output.splitlines() if "RLIMIT_NOFILE" not in ln]
    tail = lines[-1] if lines else ""
    return ok, f"{cfg.criu} {text}; criu check: {tail}", None if ok else fix


def _criu_cache(cfg: Config) -> Result:
    """CRIU's kernel-feature cache: without it every criu run probes the kernel (~20 ms
    of each clone's restore)."""
    if not criu_kdat.run_is_tmpfs():
        criu_kdat.ensure(cfg.criu)
    st = criu_kdat.status(cfg.criu)
    return st.cached, st.detail, None if st.cached else (
        f"run bunshin as root with a writable {criu_kdat.RUN}, or mount a tmpfs on {criu_kdat.RUN}")


CLONE_TASKS = 4  # tasks of a typical clone: the agent, a shell session, a command, a helper


def _clone_capacity() -> Result:
    """How many live clones the host's pid space holds: kernel.pid_max bounds the count
    first here (memory per clone is ~1-4 MiB, mounts, cgroups and fds are far from
    their limits at 1,024 clones)."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    used = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])  # threads now
    room = int(pid_max * (1 - snapshot.PID_MARGIN)) - used
    clones = max(room, 0) // CLONE_TASKS
    ok = clones >= snapshot.MAX_BATCH
    detail = (f"kernel.pid_max {pid_max}, {used} tasks now, {int(pid_max * snapshot.PID_MARGIN)} kept spare: "
              f"room for ~{clones} more clones of {CLONE_TASKS} tasks (one fork makes at most {snapshot.MAX_BATCH})")
    return ok, detail, None if ok else (
        "sysctl -w kernel.pid_max=4194304 (and kernel.threads-max if lower) for more live clones")


def _pipe_buffers() -> Result:
    """Pipe buffers each workspace's root (a host user of its own: ``host_limits``) may hold."""
    allowed = host_limits.pipes_allowed()
    if allowed is None:
        return True, "fs.pipe-user-pages-soft 0: no soft limit on a workspace's pipe buffers", None
    detail = (f"fs.pipe-user-pages-soft {host_limits.pipe_soft_pages()} pages: ~{allowed} pipes of 64 KiB "
              "per workspace (each clone's root is a host user of its own, as are its other per-user budgets)")
    return True, detail, None


def _cgroup_moves() -> Result:
    """Whether moving a restore's criu into the clone's cgroups waits for RCU (``cgroup_moves``)."""
    st = cgroup_moves.status()
    if st.mount_point is None:
        return False, "no cgroup2 mounted: each move into a cgroup may wait for an RCU grace period", None
    if st.favored:
        return True, f"{st.mount_point} favordynmods: moves into cgroups are cheap", None
    return False, (f"{st.mount_point} without favordynmods: each restore's move into its cgroups may wait "
                   "3-17 ms for an RCU grace period (bunshin turns it on at its first restore)"), (
        f"mount -o remount,{','.join((*st.flags, cgroup_moves.OPTION))} {st.mount_point}, "
        f"or leave it to bunshin; {cgroup_moves.ENV}=0 keeps it off")


def _pycriu() -> Result:
    import pycriu  # noqa: F401

    return True, f"pycriu from {Path(pycriu.__file__).parent}", None


def _isolation(cfg: Config) -> Result:
    """The isolation every workspace runs under, and whether this host can give it."""
    idmap.probe(cfg)
    actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    missing = {"errno", "kill_process", "allow"} - set(actions)
    if missing:
        return False, f"seccomp lacks {sorted(missing)}", "use a kernel with CONFIG_SECCOMP_FILTER"
    detail = (
        f"user namespace per workspace, owned by its root: a host id range of its own ({cfg.id_count} ids "
        f"above {cfg.id_base}, which owns the layers on disk), so no per-user kernel budget is "
        "shared; idmapped views of its layers and upper; seccomp deny-list of "
        f"{len(seccomp.DENIED) + len(seccomp.AT_PID1) + 3} syscalls + no_new_privs; "
        f"masked /proc ({', '.join(init.PROC_MASKED_FILES + init.PROC_MASKED_DIRS)}), read-only "
        f"/proc/{{{','.join(init.PROC_READ_ONLY)}}} and /sys; own session keyring; pid 1 unreachable from inside"
    )
    return True, detail, None


def run_checks(cfg: Config) -> list[Check]:
    return [
        _check("root", _root),
        _check("kernel", _kernel),
        _check("overlayfs", _overlay),
        _check("namespaces", _namespaces),
        _check("isolation", lambda: _isolation(cfg)),
        _check("cgroups", _cgroups),
        _check("tmpfs", lambda: _tmpfs(cfg)),
        _check("huge pages", lambda: _huge_pages(cfg), required=False),
        _check("criu", lambda: _criu(cfg), required=False),
        _check("criu cache", lambda: _criu_cache(cfg), required=False),
        _check("clone capacity", _clone_capacity, required=False),
        _check("pipe buffers", _pipe_buffers, required=False),
        _check("cgroup moves", _cgroup_moves, required=False),
        _check("pycriu", _pycriu, required=False),
    ]
