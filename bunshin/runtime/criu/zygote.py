"""The criu launcher's helper process: forks and execs criu runs for a bunshin process.

Run as a script (``python -I -S zygote.py FD``), standard library only, with the
syscall bindings of ``syscalls.py`` loaded by path: a small process whose fork costs
~0.3 ms, where a fork of the calling bunshin process (``subprocess`` with a
``preexec_fn``: no vfork) costs 3.5 ms and more as the caller grows (a server, a bench
holding 1,024 clones). ``prepared.CriuLauncher`` is the other end.

Warm network namespaces: a restore's criu starts in a fresh network namespace with
``lo`` up (``criu.Placement.new_netns``), which costs 1.3 ms on a quiet machine and
5-10 ms on a busy one. The helper keeps ``POOL`` children that have already made one
and wait for their command; a request takes one (it joins its keyring and cgroups,
mounts its sysfs, execs) and a new one is forked to take its place, off the restore's
path: the pool is refilled when no child is between its request and its exec
(a fork and a namespace made beside a starting criu delayed its exec by ~1 ms on two
busy cores). The namespace's own kernel memory is then charged to the caller's cgroup, not
the clone's (what the clone's tasks allocate in it is charged to the clone).

A small mount namespace: CRIU's restore gives the clone a mount namespace that starts as
a copy of the one criu runs in and then tears that copy down, so a criu run in the host's
namespace, which holds two or three mounts per live clone, costs more with every clone
(``unshare(CLONE_NEWNS)`` alone: 0.2 ms at 115 mounts, 6.7 ms at 3,115). At start the
helper makes one namespace, a private copy of the host's without bunshin's mounts and its
workspaces' (``small_namespace``); each warm child enters a copy of it ahead of its
request. A request whose placement names ``own_mounts`` (paths, in order) comes with a
detached copy of each of those host mounts (``syscalls.clone_tree``, made by the caller,
who sees them): the child attaches them at the same paths and criu sees exactly those,
with the host's system mounts (/, /proc, /sys, /dev). A request without them (or one that
must hold its network namespace on the host: ``hold_netns``), or one whose trees cannot
be attached, runs in the host's namespace as before. Mounts the child makes (its sysfs)
stay in its namespace, which ends with criu.

Warm criu: a restore's criu was exec'd on its path (the loader relocating ~20 libraries,
criu's start: ~3-4 ms). For a request marked ``rpc`` (``prepared.start_rpc``) the helper
keeps ``CRIU_POOL`` ``criu swrk`` processes exec'd ahead (for the argv of the first such
request), each in a fresh network namespace, a copy of the small mount namespace and a
new session keyring, waiting on an RPC socket; the helper makes those itself and
``posix_spawn``s criu into them (``spawn_warm_criu``: no fork of the helper's Python).
A request takes the oldest: the helper enters its mount namespace and attaches the request's mounts, enters its network
namespace and mounts the sysfs, moves it into the request's cgroups (``settle_criu``),
then answers ``{"id", "pid", "rpc": true}`` with the caller's end of the RPC socket, over
which the caller asks for the restore, and a pidfd of it (the caller sees it end without
waiting for this helper); its end is reported as any command's too. The exec,
the loading and criu's start are then off the restore's path. A request it cannot settle is
answered ``NoWarmCriu`` (the caller runs criu as a command), as is one that finds only
dead ones; an idle one that dies is reaped and replaced.

Protocol on the SOCK_SEQPACKET socket FD (one JSON object per message, each with the
caller's ``id``): a request ``{"id", "argv", "placement": {...}}`` with the output
file's descriptor passed alongside (SCM_RIGHTS), then one detached mount per
``placement["own_mounts"]`` entry, then with ``"pass_fd": true`` one descriptor the
command gets as its fd ``PASSED_FD`` (criu's RPC socket: ``criu swrk 3``); the answer ``{"id", "pid"}`` once the
child has exec'd, or ``{"id", "error"}`` when it could not enter its namespaces or
cgroups or exec; later ``{"id", "pid", "status"}`` (a wait status) when it has ended.
The helper ends when the socket closes (its caller is gone): its warm children go with
it, children already running criu are left to finish, as ``subprocess`` leaves them.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import importlib.util
import json
import os
import re
import select
import socket
import sys
from dataclasses import dataclass
from typing import Any

MAX_MSG = 1 << 16
MAX_FDS = 64  # descriptors one request may carry (the output file, its mounts, one passed on)
PASSED_FD = 3  # where the command finds the descriptor a request passes on
POOL = 2  # warm network namespaces kept ready
CRIU_POOL = 2  # criu swrk processes kept exec'd ahead for restores (``rpc`` requests)
# The helper's own nice value: a restore waits for its placement of the warm criu while
# the clone's cgroup is weighed up (``restore_boost``); what it forks runs at 0. Side by
# side at load 5-6, 64 restores of a 256 MiB heap: p50 45-46 against 51-55 ms at 0.
NICE = -5
# Mounts the small namespace leaves out: bunshin's tmpfs (with everything beneath it:
# workspaces, images, views), workspace uppers and roots, sysfs of workspaces, held
# network namespaces, idmapped views.
DROP_SOURCES = frozenset({"bunshin", "bunshin-upper"})
DROP_TYPES = frozenset({"overlay", "nsfs"})


def _load_syscalls() -> Any:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernel", "syscalls.py")
    spec = importlib.util.spec_from_file_location("bunshin_zygote_syscalls", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def enter(sc: Any, p: dict[str, Any], *, netns_ready: bool = False) -> None:
    """``criu.Placement.enter``, from its fields (the same order); ``netns_ready``: the
    caller is already in a fresh network namespace with lo up."""
    if p.get("own_keyring"):
        sc.join_session_keyring()
    for procs in p.get("cgroup_procs", ()):
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    for key, kind in (("timens", sc.CLONE_NEWTIME), ("utsns", sc.CLONE_NEWUTS), ("ipcns", sc.CLONE_NEWIPC)):
        if p.get(key) is not None:
            sc.setns_path(p[key], kind)
    if p.get("netns") is not None:
        fd = os.open(p["netns"], os.O_RDONLY)
        try:
            sc.setns(fd, sc.CLONE_NEWNET)
        finally:
            os.close(fd)
    elif p.get("new_netns"):
        if not netns_ready:
            sc.new_netns()
        if p.get("sysfs") is not None:
            sc.mount_sysfs(p["sysfs"])
            if p.get("hold_netns"):
                sc.hold_netns(p["sysfs"] + ".netns")
    if p.get("preload") is not None:
        os.environ["LD_PRELOAD"] = p["preload"]
    if p.get("owner") is not None:
        sc.become_keeping_caps(p["owner"])


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def dropped_mounts(mountinfo: str) -> list[str]:
    """The mount points of ``mountinfo`` that the small namespace leaves out, parents first."""
    out: list[str] = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 6 or len(tail) < 2:
            continue
        point, opts, fstype, source = _unescape(fields[4]), fields[5].split(","), tail[0], tail[1]
        if (fstype in DROP_TYPES or source in DROP_SOURCES or "idmapped" in opts
                or (fstype == "sysfs" and point != "/sys")):
            out.append(point)
    return sorted(out, key=lambda p: (p.count("/"), p))


def small_namespace(sc: Any, host_mnt: int) -> int | None:
    """A descriptor of a new mount namespace: a private copy of the caller's without the
    mounts ``dropped_mounts`` names; None if it cannot be made. The caller stays in its own."""
    try:
        sc.unshare(sc.CLONE_NEWNS)
    except OSError:
        return None
    try:
        sc.mount("none", "/", None, sc.MS_REC | sc.MS_PRIVATE)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            points = dropped_mounts(f.read())
        for point in points:  # a detached parent takes its subtree: the rest then fail
            with contextlib.suppress(OSError):
                sc.umount(point, sc.MNT_DETACH)
        return os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        sc.setns(host_mnt, sc.CLONE_NEWNS)


def sized_netns(sc: Any, host_net: int) -> int | None:
    """A descriptor of an empty network namespace whose ``tcp_child_ehash_entries`` is
    ``syscalls.NETNS_TCP_BUCKETS``: the namespaces made from it get a TCP table of that size
    without a throwaway namespace each (~1 ms, and the kernel's cleanup of it, per run).
    None if it cannot be made. The caller stays in its own."""
    try:
        sc.unshare(sc.CLONE_NEWNET)
    except OSError:
        return None
    try:
        sc.size_netns_tables()
        return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        sc.setns(host_net, sc.CLONE_NEWNET)


@dataclass(frozen=True)
class Namespaces:
    """The helper's namespaces: the host's mount namespace, the small one (None: none
    here), the host's network namespace and the sized one new ones are made from."""

    host: int
    small: int | None
    host_net: int = -1
    net_template: int | None = None

    def fds(self) -> list[int]:
        return [fd for fd in (self.host, self.small, self.host_net, self.net_template) if fd is not None and fd >= 0]


def _settle_mounts(sc: Any, p: dict[str, Any], trees: list[int], ns: Namespaces) -> None:
    """In a child inside a copy of the small namespace: attach ``trees`` where the
    placement says, or go back to the host's namespace."""
    wanted = p.get("own_mounts") or []
    if wanted and not p.get("hold_netns") and len(wanted) == len(trees):
        try:
            for (path, _recursive), fd in zip(wanted, trees, strict=True):
                sc.attach_tree(fd, path)
                sc.mount("none", path, None, sc.MS_REC | sc.MS_PRIVATE)
            return
        except OSError:
            pass  # a path the small namespace lacks: run where everything is
    sc.setns(ns.host, sc.CLONE_NEWNS)


def _split(req: dict[str, Any], fds: list[int]) -> tuple[list[int], int | None]:
    """A request's descriptors after the output file: its mount trees, and the one it
    passes on to the command (``pass_fd``: the last), if any."""
    if req.get("pass_fd") and fds:
        return fds[:-1], fds[-1]
    return fds, None


def _exec(sc: Any, req: dict[str, Any], out_fd: int, err_w: int, *, netns_ready: bool = False,
          trees: list[int] | None = None, ns: Namespaces | None = None, passed: int | None = None) -> None:
    """In a child: placement, stdio, exec. Never returns; a failure is written to ``err_w``.
    ``ns``: the child is in a copy of the small namespace (``_settle_mounts``); ``passed``:
    given to the command as its descriptor ``PASSED_FD``."""
    try:
        _plain_nice()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        if ns is not None:
            _settle_mounts(sc, req.get("placement") or {}, trees or [], ns)
        enter(sc, req.get("placement") or {}, netns_ready=netns_ready)
        low = 3
        if passed is not None:
            if err_w == PASSED_FD:
                err_w = fcntl.fcntl(err_w, fcntl.F_DUPFD_CLOEXEC, PASSED_FD + 1)
            if passed != PASSED_FD:
                os.dup2(passed, PASSED_FD)
            os.set_inheritable(PASSED_FD, True)
            low = PASSED_FD + 1
        os.closerange(low, err_w)
        os.closerange(max(err_w + 1, low), 65536)
        os.execv(req["argv"][0], req["argv"])
    except BaseException as e:  # noqa: BLE001 (reported to the caller)
        try:
            os.write(err_w, f"{type(e).__name__}: {e}".encode()[:4000])
        finally:
            os._exit(127)


def _plain_nice() -> None:
    """In a child: the nice value every process starts with, not the helper's (``NICE``)."""
    if os.getpriority(os.PRIO_PROCESS, 0) != 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, anc, _, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


@dataclass
class Warm:
    """A child in a fresh network namespace, waiting for its command on ``sock``."""

    pid: int
    sock: socket.socket
    err_r: int


def _close_all_but(*keep: int) -> None:
    """Close every descriptor above 2 except ``keep`` (a warm child must not hold its
    siblings' sockets: they would never see the helper go)."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)


def _fresh_netns(sc: Any, ns: Namespaces) -> None:
    """A fresh network namespace with lo up, made from the helper's sized one (else as
    ``syscalls.new_netns`` makes it: with a throwaway namespace first)."""
    if ns.net_template is None:
        sc.new_netns()
        return
    sc.setns(ns.net_template, sc.CLONE_NEWNET)
    sc.new_netns(sized=True)


def _warm_child(sc: Any, sock: socket.socket, err_w: int, ns: Namespaces) -> None:
    try:
        _plain_nice()
        _close_all_but(sock.fileno(), err_w, *ns.fds())
        os.setsid()
        _fresh_netns(sc, ns)
        if ns.small is not None:
            sc.setns(ns.small, sc.CLONE_NEWNS)
            sc.unshare(sc.CLONE_NEWNS)  # a copy of its own, to attach its request's mounts in
        data, fds = _recv(sock)
    except BaseException as e:  # noqa: BLE001
        with contextlib.suppress(OSError):
            os.write(err_w, f"{type(e).__name__}: {e}".encode()[:4000])
        os._exit(127)
    if not data or not fds:
        os._exit(0)  # the helper is gone, or retired this child
    req = json.loads(data)
    trees, passed = _split(req, fds[1:])
    _exec(sc, req, fds[0], err_w, netns_ready=True, trees=trees, passed=passed,
          ns=ns if ns.small is not None else None)


_CLOSE_RANGE = 436  # x86_64
_CLOSE_RANGE_CLOEXEC = 1 << 2


def _cloexec_all(sc: Any) -> None:
    """Mark every descriptor of the helper above 2 close-on-exec (one ``close_range``): a
    command spawned from it (``spawn_warm_criu``) gets only what its file actions give."""
    import ctypes  # noqa: PLC0415 (the helper's only use)

    sc.syscall(_CLOSE_RANGE, ctypes.c_uint(3), ctypes.c_uint(0xFFFFFFFF), ctypes.c_uint(_CLOSE_RANGE_CLOEXEC))


def spawn_warm_criu(sc: Any, argv: list[str], rpc: int, ns: Namespaces) -> tuple[int, int, int]:
    """Start ``argv`` (``criu swrk PASSED_FD``) with ``rpc`` as its descriptor ``PASSED_FD``
    and /dev/null as stdio, in a fresh network namespace, a copy of the small mount
    namespace, a new session keyring and its own session, at nice 0: (pid, its mount
    namespace, its network namespace), both close-on-exec descriptors.

    The helper makes the namespaces and the keyring itself and ``posix_spawn``s criu into
    them (vfork semantics: no copy of the helper's Python heap, whose copy-on-write faults,
    page tables and teardown at exec cost a forked child ~2 ms of CPU), then goes back to
    its own namespaces and joins another new keyring, so criu's is criu's alone. Nothing
    of the helper but the descriptors the file actions name reaches criu (``_cloexec_all``).
    OSError if any step fails (the helper is back in its own namespaces then)."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    try:
        _fresh_netns(sc, ns)
        assert ns.small is not None
        sc.setns(ns.small, sc.CLONE_NEWNS)
        sc.unshare(sc.CLONE_NEWNS)
        mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            sc.join_session_keyring()
            _cloexec_all(sc)
            if nice != 0:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
            dup = os.POSIX_SPAWN_DUP2
            pid = os.posix_spawn(argv[0], argv, os.environ, setsid=True,
                                 file_actions=[(dup, null, 0), (dup, null, 1), (dup, null, 2), (dup, rpc, PASSED_FD)])
        except BaseException:
            os.close(mnt)
            os.close(net)
            raise
    finally:
        os.close(null)
        sc.setns(ns.host_net, sc.CLONE_NEWNET)
        sc.setns(ns.host, sc.CLONE_NEWNS)
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, 0) != nice:
                os.setpriority(os.PRIO_PROCESS, 0, nice)
    try:
        sc.join_session_keyring()  # the helper's own again: criu's keyring is no one else's
    except OSError:
        os.kill(pid, 9)  # it would share its keyring with everything the helper starts next
        os.waitpid(pid, 0)
        os.close(mnt)
        os.close(net)
        raise
    return pid, mnt, net


@dataclass
class WarmCriu:
    """A ``criu swrk`` exec'd ahead in its own namespaces: the helper's end of its RPC
    socket, its pidfd and its mount and network namespaces."""

    pid: int
    rpc: socket.socket
    pidfd: int = -1
    mnt: int = -1
    net: int = -1

    def close(self) -> None:
        for fd in (self.pidfd, self.mnt, self.net):
            if fd >= 0:
                os.close(fd)
        self.pidfd = self.mnt = self.net = -1


def settle_criu(sc: Any, w: WarmCriu, p: dict[str, Any], trees: list[int], ns: Namespaces) -> None:
    """Give a warm criu its restore's placement from outside, in the helper: ``trees``
    attached at ``own_mounts``' paths in its mount namespace, the sysfs of its network
    namespace at ``sysfs``, the process moved into ``cgroup_procs``. The helper is back in
    its own namespaces after, also on failure (OSError)."""
    wanted = p.get("own_mounts") or []
    if len(wanted) != len(trees):
        raise OSError("a request's mounts and their descriptors differ in number")
    try:
        sc.setns(w.mnt, sc.CLONE_NEWNS)
        for (path, _recursive), fd in zip(wanted, trees, strict=True):
            sc.attach_tree(fd, path)
            sc.mount("none", path, None, sc.MS_REC | sc.MS_PRIVATE)
        if p.get("sysfs") is not None:
            sc.setns(w.net, sc.CLONE_NEWNET)
            sc.mount_sysfs(p["sysfs"])
    finally:
        sc.setns(ns.host_net, sc.CLONE_NEWNET)
        sc.setns(ns.host, sc.CLONE_NEWNS)
    for procs in p.get("cgroup_procs", ()):
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(w.pid).encode())
        finally:
            os.close(fd)


@dataclass
class Starting:
    """A child between fork and exec: its request id, its error pipe."""

    pid: int
    rid: Any


class Zygote:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sc = _load_syscalls()
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.starting: dict[int, Starting] = {}  # err pipe fd -> child
        self.running: dict[int, Starting] = {}  # pidfd -> child
        self.warm: list[Warm] = []
        self.chunks: dict[int, list[bytes]] = {}
        host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        host_net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.ns = Namespaces(host, small_namespace(self.sc, host), host_net, sized_netns(self.sc, host_net))
        # warm criu (``rpc`` requests): the argv they run, those ready (pidfd ->, oldest
        # first), requests waiting for one
        self.criu_argv: list[str] | None = None
        self.criu_ready: dict[int, WarmCriu] = {}
        self.criu_waiting: list[tuple[dict[str, Any], int, list[int]]] = []
        self.criu_broken: str | None = None  # why warm criu cannot be made here
        self.closed: set[int] = set()  # watched descriptors closed since the last poll

    def _fork(self, req: dict[str, Any], out_fd: int, passed: int | None = None) -> tuple[int, int]:
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            os.close(err_r)
            os.setsid()
            _exec(self.sc, req, out_fd, err_w, passed=passed)
        os.close(err_w)
        return pid, err_r

    def _add_warm(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            mine.close()
            os.close(err_r)
            _warm_child(self.sc, theirs, err_w, self.ns)
        theirs.close()
        os.close(err_w)
        self.warm.append(Warm(pid, mine, err_r))

    # ------------------------------------------------------------- warm criu

    def _add_warm_criu(self) -> None:
        """One more ready warm criu (``spawn_warm_criu``); if it cannot be made, warm criu
        is off in this helper and every waiting request is refused (run as a command)."""
        assert self.criu_argv is not None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            pid, mnt, net = spawn_warm_criu(self.sc, self.criu_argv, theirs.fileno(), self.ns)
        except OSError as e:
            mine.close()
            self.criu_broken = f"a warm criu could not start: {e}"
            for req, out_fd, fds in self.criu_waiting:  # the caller runs these the other way
                self._refuse(req, out_fd, fds, self.criu_broken)
            self.criu_waiting.clear()
            return
        finally:
            theirs.close()
        w = WarmCriu(pid, mine, mnt=mnt, net=net)
        try:
            w.pidfd = os.pidfd_open(pid)
        except OSError as e:
            self._retire(w)
            self.criu_broken = f"a warm criu could not be watched: {e}"
            return
        self.criu_ready[w.pidfd] = w
        self.poller.register(w.pidfd, select.POLLIN)  # an idle one that ends is reaped
        while self.criu_waiting and self.criu_ready:
            self._serve_criu(*self.criu_waiting.pop(0))

    def _drop(self, fd: int) -> None:
        """Stop watching ``fd`` and close it; an event of it already polled is skipped."""
        with contextlib.suppress(KeyError):
            self.poller.unregister(fd)
        os.close(fd)
        self.closed.add(fd)

    def _retire(self, w: WarmCriu) -> None:
        """End a warm criu that serves nobody (its socket closed: it exits) and reap it."""
        if w.pidfd >= 0:
            self._drop(w.pidfd)
            w.pidfd = -1
        w.rpc.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, 9)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(w.pid, 0)
        w.close()

    def _refuse(self, req: dict[str, Any], out_fd: int, fds: list[int], why: str) -> None:
        os.close(out_fd)
        for fd in fds:
            os.close(fd)
        _send(self.sock, {"id": req["id"], "error": f"NoWarmCriu: {why}"})

    def start_criu(self, req: dict[str, Any], out_fd: int, fds: list[int]) -> None:
        """An ``rpc`` request: hand a warm criu to the caller, or queue it until one is ready."""
        if self.ns.small is None or self.criu_broken is not None:
            self._refuse(req, out_fd, fds, self.criu_broken or "no small mount namespace here")
            return
        if req["argv"] != self.criu_argv:  # the first request (or another criu): a pool for it
            for w in list(self.criu_ready.values()):
                self._retire(w)
            self.criu_ready.clear()
            self.criu_argv = list(req["argv"])
        self.criu_waiting.append((req, out_fd, fds))
        while self.criu_waiting and self.criu_ready:
            self._serve_criu(*self.criu_waiting.pop(0))
        if self.criu_waiting:  # none ready: one made on its path
            self._add_warm_criu()

    def _take_criu(self) -> WarmCriu | None:
        """The oldest ready warm criu still alive (dead ones on the way are reaped)."""
        while self.criu_ready:
            pidfd = next(iter(self.criu_ready))
            w = self.criu_ready.pop(pidfd)
            self.poller.unregister(pidfd)
            if not select.select([pidfd], [], [], 0)[0]:
                return w
            self._retire(w)  # it ended while idle
        return None

    def _serve_criu(self, req: dict[str, Any], out_fd: int, fds: list[int]) -> None:
        w = self._take_criu()
        if w is None:  # none alive after all: run as a command (the pool is refilled after)
            self._refuse(req, out_fd, fds, "the warm criu ended before its request")
            return
        pidfd = w.pidfd
        os.close(out_fd)  # criu answers on its socket; its output went to /dev/null
        try:
            settle_criu(self.sc, w, req.get("placement") or {}, fds, self.ns)
        except OSError as e:
            self._retire(w)
            _send(self.sock, {"id": req["id"], "error": f"NoWarmCriu: {type(e).__name__}: {e}"})
            return
        finally:
            for fd in fds:
                os.close(fd)
        os.close(w.mnt)
        os.close(w.net)
        w.mnt = w.net = -1
        self.running[pidfd] = Starting(w.pid, req["id"])  # its end is reported as any command's
        self.poller.register(pidfd, select.POLLIN)
        _send(self.sock, {"id": req["id"], "pid": w.pid, "rpc": True}, [w.rpc.fileno(), pidfd])
        w.rpc.close()

    def _idle_criu_ended(self, pidfd: int) -> None:
        self._retire(self.criu_ready.pop(pidfd))

    def _refill_criu(self) -> None:
        if self.criu_argv is None or self.criu_broken is not None or self.ns.small is None:
            return
        while len(self.criu_ready) < CRIU_POOL and self.criu_broken is None:
            self._add_warm_criu()

    # ------------------------------------------------------------- commands

    def start(self, req: dict[str, Any], out_fd: int, fds: list[int]) -> None:
        if req.get("rpc"):
            self.start_criu(req, out_fd, fds)
            return
        p = req.get("placement") or {}
        trees, passed = _split(req, fds)
        if p.get("new_netns") and p.get("netns") is None:
            if not self.warm:  # none ready (the first request, or a burst): one made on its path
                self._add_warm()
            w = self.warm.pop(0)
            try:
                w.sock.sendmsg([json.dumps(req).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                             array.array("i", [out_fd, *fds]))])
                pid, err_r = w.pid, w.err_r
            except OSError:  # it died: start this one cold
                os.close(w.err_r)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(w.pid, 0)
                pid, err_r = self._fork(req, out_fd, passed)
            w.sock.close()
        else:
            pid, err_r = self._fork(req, out_fd, passed)  # in the host's namespace: trees unused
        os.close(out_fd)
        for fd in fds:  # the child has its own copies (or none: a dissolved tree)
            os.close(fd)
        self.starting[err_r] = Starting(pid, req["id"])
        self.chunks[err_r] = []
        self.poller.register(err_r, select.POLLIN)

    def _started(self, err_r: int) -> None:
        chunk = os.read(err_r, 4096)
        if chunk:
            self.chunks[err_r].append(chunk)
            return
        child = self.starting.pop(err_r)  # EOF: exec'd (CLOEXEC) or failed and wrote why
        error = b"".join(self.chunks.pop(err_r)).decode(errors="replace")
        self._drop(err_r)
        if error:
            os.waitpid(child.pid, 0)
            _send(self.sock, {"id": child.rid, "error": error})
            return
        pidfd = os.pidfd_open(child.pid)
        self.running[pidfd] = child
        self.poller.register(pidfd, select.POLLIN)
        _send(self.sock, {"id": child.rid, "pid": child.pid})

    def _ended(self, pidfd: int) -> None:
        child = self.running.pop(pidfd)
        self._drop(pidfd)
        _, status = os.waitpid(child.pid, 0)
        _send(self.sock, {"id": child.rid, "pid": child.pid, "status": status})

    def serve(self) -> None:
        """Answer requests until the socket closes."""
        try:
            while True:
                if not self.starting:  # refilled only while no child is on its way to exec
                    while len(self.warm) < POOL:
                        self._add_warm()
                    self._refill_criu()
                self.closed.clear()
                for fd, _ in self.poller.poll():
                    if fd in self.closed:  # closed (and its number maybe reused) while this batch ran
                        continue
                    if fd in self.starting:
                        self._started(fd)
                    elif fd in self.running:
                        self._ended(fd)
                    elif fd in self.criu_ready:
                        self._idle_criu_ended(fd)
                    elif fd == self.sock.fileno():
                        data, fds = _recv(self.sock)
                        if not data:
                            return
                        self.start(json.loads(data), fds[0] if fds else os.open("/dev/null", os.O_WRONLY), fds[1:])
        finally:
            for w in self.warm:  # a warm child reads EOF and exits
                w.sock.close()
                os.close(w.err_r)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(w.pid, 0)
            for wc in list(self.criu_ready.values()):
                self._retire(wc)  # its socket closes: criu swrk ends


def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    if fds:
        sock.sendmsg([json.dumps(msg).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(json.dumps(msg).encode())


if __name__ == "__main__":
    with contextlib.suppress(OSError):  # without CAP_SYS_NICE it runs at 0
        os.setpriority(os.PRIO_PROCESS, 0, NICE)
    Zygote(socket.socket(fileno=int(sys.argv[1]))).serve()
