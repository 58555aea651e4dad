"""A small, stateless wrapper around the ``criu`` binary.

Every call takes the binary's path, runs it with ``-v4`` and a log file in the
images directory, and returns a ``CriuRun`` (wall time, log path, and for a
restore the restored root task's host pid). A failure raises ``CriuError``
carrying CRIU's first real errors (``first_errors``), the last lines of its log and
the log's path. Callers add their own options (cgroups,
``--root``, network lock, ``--external``, action scripts ...) through ``extra``,
and choose where the criu process itself runs with a ``Placement``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bunshin.errors import CriuError, HostUnsupported, InvalidArgument

from ..kernel import syscalls as sc
from . import freeze_boost, prepared
from . import kdat as criu_kdat
from . import launch as criu_launch
from . import swrk as criu_swrk
from .zygote import PASSED_FD

LOG_TAIL_LINES = 30
FIRST_ERRORS = 4  # error lines shown from the first real one on
# CRIU's logs mark errors ``Error (file.c:line): ...``; a line's prefix is its timestamp
# (from ``-v3`` on) and, in a task's part of the log, the task's pid.
_ERROR = re.compile(r"^(?:\(\s*[\d.]+\))?\s*(?:(\d+): )?Error \(([^)]*)\): (.*)$")
# Errors CRIU logs on every run here that change nothing: it cannot raise its own
# RLIMIT_NOFILE (no CAP_SYS_RESOURCE on these machines), and after a failed restore
# its cgroup daemon complains that its peer went away.
HARMLESS = (
    re.compile(r"Can't setup RLIMIT_NOFILE for self"),
    re.compile(r"cgroupd: recv req error"),
)
# Every dump and restore ends: a crafted image (a loaded snapshot folder) must not
# hang ``criu restore`` forever. On timeout the criu process is killed (CriuError).
DUMP_TIMEOUT_S = 300.0
RESTORE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CriuRun:
    """One finished CRIU run."""

    duration_ms: float
    log: Path
    pid: int | None = None  # restore: the restored root task's pid on the host


@dataclass(frozen=True)
class Placement:
    """Namespaces and cgroups the criu process enters before it starts.

    CRIU dumps only the namespaces in which the tree differs from its own, and
    restored tasks inherit criu's. So a dump run inside the workspace's network
    namespace leaves the namespace out of the image (no links, rules or conntrack
    to dump: ~30 ms less pause), and a restore run inside a fresh one with ``lo``
    up, and inside the clone's cgroups, puts the clone there without CRIU's
    cgroup management.
    """

    netns: str | None = None  # join this network namespace (e.g. /proc/PID/ns/net)
    # join this time namespace (``dump`` joins the tree's: CRIU then reads the tree's
    # clocks itself instead of forking a dumper into it, ~0.7 ms of the pause)
    timens: str | None = None
    # join these UTS and IPC namespaces (a fork's dump joins the tree's: no dumper forked
    # into each; ``joined_ns`` puts them back into the images)
    utsns: str | None = None
    ipcns: str | None = None
    new_netns: bool = False  # or unshare a fresh one and bring lo up
    cgroup_procs: tuple[str, ...] = ()  # cgroup.procs files to join
    # a new session keyring: restored tasks keep criu's, which would be the host's
    own_keyring: bool = False
    # with new_netns: mount that namespace's sysfs here (a restore passes it as the
    # external /sys mount; it stays until the clone's folder is unmounted, or with
    # ``own_mounts`` until criu ends, the clone keeping its own copy).
    sysfs: str | None = None
    # with sysfs: keep this namespace alive with it (a bind of it beside the sysfs) when the
    # restored tasks get a namespace of their own (``netns_image``): the sysfs's devices
    # live only as long as it does. Not otherwise: a mount more to copy in every restore.
    hold_netns: bool = False
    # with the warm helper (``prepared``): run in a small mount namespace of its own, the
    # host's system mounts and only these host mounts, ``(path, with what is beneath)``,
    # attached at the same paths in this order (``zygote``): the clone's namespace, a copy
    # of criu's, then no longer holds every other clone's mounts. The sysfs is then
    # mounted there only. Ignored without the helper and with ``hold_netns``.
    own_mounts: tuple[tuple[str, bool], ...] = ()
    # run criu as this host uid and gid, keeping its capabilities: the user namespace a
    # restore makes is then owned by it (a clone's own range: ``idranges``), not host root
    owner: int | None = None
    # a library criu loads (``LD_PRELOAD``; a warm criu: ``ld.so --preload``): a restore's
    # ``userns_owner`` helper, which makes the clone's user namespace owned by its own root
    preload: str | None = None

    def enter(self) -> None:
        """Runs in the criu child between fork and exec: plain syscalls only."""
        if self.own_keyring:
            sc.join_session_keyring()
        for procs in self.cgroup_procs:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")
            finally:
                os.close(fd)
        for path, kind in ((self.timens, sc.CLONE_NEWTIME), (self.utsns, sc.CLONE_NEWUTS),
                           (self.ipcns, sc.CLONE_NEWIPC)):
            if path is not None:
                sc.setns_path(path, kind)
        if self.netns is not None:
            fd = os.open(self.netns, os.O_RDONLY)
            try:
                sc.setns(fd, sc.CLONE_NEWNET)
            finally:
                os.close(fd)
        elif self.new_netns:
            sc.new_netns()
            if self.sysfs is not None:
                sc.mount_sysfs(self.sysfs)
                if self.hold_netns:
                    sc.hold_netns(self.sysfs + ".netns")
        if self.preload is not None:
            os.environ["LD_PRELOAD"] = self.preload
        if self.owner is not None:
            sc.become_keeping_caps(self.owner)


def owned(placement: Placement | None) -> list[str]:
    """CRIU's options for a run as ``placement.owner``: CRIU checks for root by its euid, and
    takes a run with every capability but another uid for ``--unprivileged`` (which changes
    only where a capability is missing: none here; and its kernel-feature cache's place)."""
    return ["--unprivileged"] if placement is not None and placement.owner is not None else []


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def first_errors(path: Path, limit: int = FIRST_ERRORS) -> list[str]:
    """CRIU's first real error lines in the log at ``path`` (the harmless ones skipped),
    ``limit`` at most, in log order, each as ``[task PID: ]message (file.c:line)``.

    The first one says what went wrong; the ones after it are mostly its consequences
    ("Unable to open fd=4", "5 exited, status=1", "Restoring FAILED"), which is often all
    the log's tail holds.
    """
    found: list[str] = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                if b"Error (" not in raw:
                    continue
                m = _ERROR.match(raw.decode(errors="replace").rstrip())
                if m is None or any(h.search(m.group(3)) for h in HARMLESS):
                    continue
                task, where, what = m.groups()
                line = f"{f'task {task}: ' if task else ''}{what} ({where})"
                if line not in found:  # CRIU repeats some as it retries
                    found.append(line)
                if len(found) >= limit:
                    break
    except OSError:
        return []
    return found


def _failure(action: str, returncode: int, log: Path | None, output: str) -> CriuError:
    """The error of a criu run that exited non-zero: its first real error in the message."""
    errors = first_errors(log) if log else []
    tail = (_tail(log) if log else "") or "\n".join(output.splitlines()[-LOG_TAIL_LINES:])
    if not errors:  # no log (criu failed before writing one): look at what it printed
        errors = [line.strip() for line in output.splitlines() if "Error" in line][:FIRST_ERRORS]
    first = f": {errors[0]}" if errors else ""
    return CriuError(
        f"criu {action} failed with exit code {returncode}{first}",
        log_tail=tail,
        first_errors="\n".join(errors),
        action=action,
        returncode=returncode,
        log=str(log) if log else None,
    )


def _run(
    criu: Path, args: Sequence[str], *, action: str, log: Path | None, timeout: float | None,
    placement: Placement | None = None,
) -> float:
    """Run criu; return the wall time in ms or raise CriuError."""
    criu_kdat.ensure(criu)  # its kernel-feature cache: ~20 ms less per run where /run is no tmpfs
    argv = [*criu_launch.argv(criu), *args]  # the loader directly: no shell (~4 ms)
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        try:  # forked by a small helper kept warm (``prepared``), else by this process
            ran = prepared.run(argv, placement, out.fileno(), timeout)
            returncode, expired = ran if ran is not None else _popen_wait(argv, placement, out, timeout, action)
        except (subprocess.SubprocessError, prepared.LaunchError) as exc:
            raise CriuError(f"criu {action} could not enter its namespaces or cgroups: {exc}",
                            action=action) from exc
        except FileNotFoundError as exc:
            raise HostUnsupported(
                f"criu not found at {criu}", hint="install CRIU >= 4.2 (see DESIGN.md)"
            ) from exc
        if expired:
            raise CriuError(f"criu {action} timed out after {timeout} s",
                            log_tail=_tail(log) if log else "", action=action)
        duration_ms = (time.monotonic() - t0) * 1000
        if returncode != 0:
            out.seek(0)
            raise _failure(action, returncode, log, out.read().decode(errors="replace").strip())
    return duration_ms


def _popen_wait(argv: list[str], placement: Placement | None, out: IO[bytes], timeout: float | None,
                action: str) -> tuple[int, bool]:
    """Fork criu from this process and wait: (exit code, whether the timeout killed it)."""
    env = criu_launch.env()
    if placement is not None and placement.preload is not None:
        env["LD_PRELOAD"] = placement.preload
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        close_fds=True,
        env=env,
        preexec_fn=placement.enter if placement else None,  # noqa: PLW1509 (syscalls only)
    )
    # A blocking wait with a timer that kills criu, not ``wait(timeout)``: that polls
    # with sleeps growing to 50 ms and added ~25 ms to every restore.
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, expire) if timeout is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        if timer is not None:
            timer.cancel()
    return proc.returncode, expired.is_set()


def dump(
    criu: Path,
    pid: int,
    images_dir: Path,
    *,
    leave_running: bool = True,
    extra: Sequence[str] = (),
    log_name: str = "dump.log",
    timeout: float | None = DUMP_TIMEOUT_S,
    placement: Placement | None = None,
    notify: Mapping[str, Callable[[], None]] | None = None,
    log_level: int = 4,
    rpc_config: Path | None = None,
) -> CriuRun:
    """Dump the process tree rooted at ``pid`` into ``images_dir`` (created if missing).

    criu runs in the tree's time namespace (``Placement.timens``). With ``notify`` it runs
    as ``criu swrk`` (``criu_swrk``): each handler runs in this process when CRIU reaches
    its stage (``"post-dump"``: the tasks are still frozen), where an action script would
    be a process started inside the pause; a handler that raises fails the dump with its
    own error. ``rpc_config``: a CRIU configuration file that dump applies over its request
    (``criu_dump_conf``).
    """
    images_dir = Path(images_dir).absolute()
    images_dir.mkdir(parents=True, exist_ok=True)
    log = images_dir / log_name
    extra = [*extra, *owned(placement)]
    timens = f"/proc/{pid}/ns/time"
    if os.path.exists(timens):
        placement = dataclasses.replace(placement or Placement(), timens=timens)
    if notify is not None:
        flags = [*(["--leave-running"] if leave_running else []), *extra]
        ms = _run_swrk(criu, pid, images_dir, log, flags, notify, timeout, placement, log_level, rpc_config)
        return CriuRun(duration_ms=ms, log=log)
    args = ["dump", "-t", str(pid), "-D", str(images_dir), f"-v{log_level}", "--log-file", str(log)]
    if leave_running:
        args.append("--leave-running")
    ms = _run(criu, [*args, *extra], action="dump", log=log, timeout=timeout, placement=placement)
    return CriuRun(duration_ms=ms, log=log)


class _Popened:
    """A ``criu swrk`` this process forked itself (no warm helper): ``prepared.Started``'s calls."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc, self.pid = proc, proc.pid

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.proc.kill()


def _start_swrk(criu: Path, sock: socket.socket, placement: Placement | None, out: IO[bytes]
                ) -> prepared.Started | _Popened:
    """``criu swrk`` on ``sock``, started by the warm helper (or by this process)."""
    argv = [*criu_launch.argv(criu), "swrk"]
    try:
        started = prepared.start([*argv, str(PASSED_FD)], placement, out.fileno(), pass_fd=sock.fileno())
        if started is not None:
            return started
        return _Popened(subprocess.Popen(
            [*argv, str(sock.fileno())], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            pass_fds=(sock.fileno(),), preexec_fn=placement.enter if placement else None,  # noqa: PLW1509
        ))
    except (subprocess.SubprocessError, prepared.LaunchError) as exc:
        raise CriuError(f"criu dump could not enter its namespaces or cgroups: {exc}", action="dump") from exc
    except FileNotFoundError as exc:
        raise HostUnsupported(f"criu not found at {criu}", hint="install CRIU >= 4.2 (see DESIGN.md)") from exc


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    def both() -> None:
        first()
        if second is not None:
            second()
    return both


def _run_swrk(criu: Path, pid: int, images_dir: Path, log: Path, flags: Sequence[str],
              notify: Mapping[str, Callable[[], None]], timeout: float | None, placement: Placement | None,
              log_level: int, rpc_config: Path | None = None) -> float:
    """One dump over CRIU's RPC socket; its wall time in ms, or CriuError (or the error of
    the first notification handler that failed)."""
    criu_kdat.ensure(criu)
    req = criu_swrk.request(-1, pid, log.name, flags, log_level=log_level)  # refused options before anything starts
    if rpc_config is not None:
        req.opts.config_file = str(rpc_config)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    dfd = -1
    with tempfile.TemporaryFile() as out:
        t0 = time.monotonic()
        try:
            try:
                child = _start_swrk(criu, theirs, placement, out)
            finally:
                theirs.close()
            try:
                dfd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                req.opts.images_dir_fd = dfd  # criu opens it through /proc/<this pid>/fd
                mine.settimeout(timeout)
                # criu and this thread (which answers its notifications) at real-time
                # priority from the pre-dump stage (the freeze comes next), at most its budget
                boost = freeze_boost.Boost((child.pid, threading.get_native_id()), latency=True)
                boost.arm()  # its timer thread started now, not at pre-dump (just before the freeze)
                try:
                    handlers = {**notify, "pre-dump": _then(boost.start, notify.get("pre-dump"))}
                    answer = criu_swrk.converse(mine, req, handlers)
                except OSError as exc:
                    if isinstance(exc, TimeoutError):
                        raise
                    answer = criu_swrk.Answer(False, 0, f"criu's socket: {exc}")  # it ended: its output says why
                finally:
                    boost.stop()
            except TimeoutError as exc:
                child.kill()
                child.wait()
                raise CriuError(f"criu dump timed out after {timeout} s", log_tail=_tail(log), action="dump") from exc
            except BaseException:
                child.kill()
                child.wait()
                raise
            mine.close()  # criu ends after its answer
            code = child.wait(timeout)
            if code is None:
                child.kill()
                code = child.wait()
        finally:
            mine.close()
            if dfd >= 0:
                os.close(dfd)
        duration_ms = (time.monotonic() - t0) * 1000
        if answer.handler_error is not None:
            raise answer.handler_error
        if not answer.success or code:
            out.seek(0)
            raise _failure("dump", code or 1, log, out.read().decode(errors="replace").strip())
    return duration_ms


def restore(
    criu: Path,
    images_dir: Path,
    *,
    pidfile: Path,
    extra: Sequence[str] = (),
    root: Path | None = None,
    log_name: str | None = None,
    timeout: float | None = RESTORE_TIMEOUT_S,
    placement: Placement | None = None,
    keep_log: bool = True,
    log_level: int = 4,
) -> CriuRun:
    """Restore ``images_dir`` detached; return the restored root task's host pid.

    Several restores of one images directory may run at once: each needs its
    own ``pidfile`` and log (the default log name is unique). ``keep_log=False``
    deletes the log of a restore that succeeded (~90 KiB of tmpfs per restore).

    A ``placement`` a warm criu can take (``prepared.rpc_fits``) is restored over RPC by a
    ``criu swrk`` the launcher exec'd ahead (``_restore_warm``: no exec, dynamic loading
    or start of criu on the restore's path); otherwise, or when none can be had, criu is
    run as a command. The ``pidfile`` is written by the command only.
    """
    images_dir = Path(images_dir).absolute()
    pidfile = Path(pidfile).absolute()
    log = images_dir / (log_name or f"restore-{uuid.uuid4().hex[:12]}.log")
    pidfile.unlink(missing_ok=True)
    args = [
        "restore",
        "-D",
        str(images_dir),
        "-v4",
        "--log-file",
        str(log),
        "--restore-detached",
        "--pidfile",
        str(pidfile),
    ]
    if root is not None:
        args += ["--root", str(root)]
    extra = [*extra, *owned(placement)]
    warm = _restore_warm(criu, images_dir, log, extra, root, timeout, placement, log_level)
    if warm is not None:
        ms, pid = warm
    else:
        args[args.index("-v4")] = f"-v{log_level}"
        ms = _run(criu, [*args, *extra], action="restore", log=log, timeout=timeout, placement=placement)
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise CriuError(
                "criu restore succeeded but wrote no readable pidfile",
                log_tail=_tail(log),
                action="restore",
            ) from exc
    if not keep_log:
        log.unlink(missing_ok=True)
    return CriuRun(duration_ms=ms, log=log, pid=pid)


def _restore_warm(criu: Path, images_dir: Path, log: Path, flags: Sequence[str], root: Path | None,
                  timeout: float | None, placement: Placement | None, log_level: int) -> tuple[float, int] | None:
    """A restore by a warm ``criu swrk`` (``prepared.start_rpc``): (wall ms, restored pid),
    or None when none can take it (the caller runs criu as a command). Failures of the
    restore itself are CriuError, as a command's."""
    if not prepared.rpc_fits(placement) or not criu_launch.warmable(criu):
        return None
    try:
        req = criu_swrk.restore_request(str(images_dir), log.name, flags, root=None if root is None else str(root),
                                        log_level=log_level)
    except (InvalidArgument, HostUnsupported):
        return None  # an option RPC has no field for, or no pycriu: the command takes it
    criu_kdat.ensure(criu)
    argv = [*criu_launch.argv(criu, None if placement is None else placement.preload), "swrk", str(PASSED_FD)]
    t0 = time.monotonic()
    try:
        with open(os.devnull, "wb") as null:  # criu answers on its socket and logs to its file
            started = prepared.start_rpc(argv, placement, null.fileno())
    except prepared.LaunchError:
        return None
    if started is None:
        return None
    child, sock = started
    try:
        try:
            sock.settimeout(timeout)
            answer = criu_swrk.restore(sock, req)
        except TimeoutError as exc:
            child.kill()
            child.wait()
            child.close()
            raise CriuError(f"criu restore timed out after {timeout} s", log_tail=_tail(log),
                            action="restore") from exc
        except OSError as exc:  # it ended: its log says why
            answer = criu_swrk.Restored(False, -1, f"criu's socket: {exc}")
            if not log.exists():  # before it read the request (killed while idle): nothing was restored
                child.kill()
                child.wait()
                child.close()
                return None
        except BaseException:
            child.kill()
            child.wait()
            child.close()
            raise
    finally:
        sock.close()  # criu ends after its answer
    try:
        if answer.success and answer.pid > 0:  # restored: wait for criu to be gone from the clone's cgroups
            if not child.gone(timeout):
                child.kill()
                child.wait()
            return (time.monotonic() - t0) * 1000, answer.pid
        code = child.wait(timeout)
        if code is None:
            child.kill()
            code = child.wait()
    finally:
        child.close()
    if not log.exists():  # it ended before it read the request
        return None
    raise _failure("restore", code or 1, log, answer.errmsg)


def _capture(criu: Path, args: Sequence[str], timeout: float | None) -> subprocess.CompletedProcess[str]:
    """Run a short criu command and capture its output (no log file)."""
    return subprocess.run(
        [str(criu), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        close_fds=True,
        timeout=timeout,
        check=False,
    )


def check(criu: Path, *, extra: Sequence[str] = (), timeout: float | None = 60) -> tuple[bool, str]:
    """``criu check``: (whether it passed, its output)."""
    try:
        proc = _capture(criu, ["check", *extra], timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def version(criu: Path, *, timeout: float | None = 30) -> str:
    """The CRIU version, e.g. ``"4.2.1"``."""
    try:
        proc = _capture(criu, ["--version"], timeout)
    except FileNotFoundError as exc:
        raise HostUnsupported(
            f"criu not found at {criu}", hint="install CRIU >= 4.2 (see DESIGN.md)"
        ) from exc
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuError(f"criu --version failed: {exc}", action="version") from exc
    for line in proc.stdout.splitlines():
        if line.strip().lower().startswith("version:"):
            return line.split(":", 1)[1].strip()
    raise CriuError(
        "criu --version printed no version",
        log_tail=(proc.stdout + proc.stderr)[-2000:],
        action="version",
    )
