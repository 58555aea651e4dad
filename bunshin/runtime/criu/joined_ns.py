"""A fork's dump run in the tree's UTS and IPC namespaces, which are then put back into its images.

CRIU dumps a namespace only where the tree's differs from its own, and each one it
dumps costs a process it forks inside the pause (the UTS and the IPC dumpers: 0.6-1.2 ms
of a delta's pause, measured with criu joining both, 16 dumps each, alternated, load
~12). So a fork's criu joins the tree's two namespaces (``criu.Placement.utsns`` and
``ipcns``), and this module writes what CRIU's dumpers would have written, read while
the tasks are frozen by a thread of this process that joins the same namespaces
(``Reader``: made before the dump, reading at ``query-ext-files``, awaited at
``post-dump``): the host and domain name, and the IPC namespace's sysctls (CRIU's
``ipc_sysctl_req``, the same files and rules). ``add`` then gives the inventory's
``root_ids`` (the namespaces criu was in) ids of their own, as ``netns_image`` does for
the network namespace, so the clone's restore makes both namespaces again (in its user
namespace: its root may still set its host name) from those images.

SysV objects (shared memory, message queues, semaphores) are CRIU's to dump: a tree
whose IPC namespace holds any (``/proc/sysvipc``, read in it: ``sysv_objects``, before
the dump) is dumped with criu in its own namespaces; one made between that look and the
freeze fails the dump (at ``post-dump``: ``HasSysvObjects``; a mapped segment already in
CRIU's memory dump: ``SYSV_SHM_ELSEWHERE`` in its error), which is then made again so.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import BunshinError
from ..kernel import syscalls as sc
from ..memfile.criu_images import load, save

SYSCTL = "/proc/sys"
#: IpcVarEntry fields and their sysctls (CRIU's ipc_sysctl_req): the mandatory ones ...
IPC_VARS = (
    ("msg_ctlmax", "kernel/msgmax"), ("msg_ctlmnb", "kernel/msgmnb"), ("auto_msgmni", "kernel/auto_msgmni"),
    ("msg_ctlmni", "kernel/msgmni"), ("shm_ctlmax", "kernel/shmmax"), ("shm_ctlall", "kernel/shmall"),
    ("shm_ctlmni", "kernel/shmmni"), ("shm_rmid_forced", "kernel/shm_rmid_forced"),
)
#: ... the message queues' (where /proc/sys/fs/mqueue is) ...
MQ_VARS = (
    ("mq_queues_max", "fs/mqueue/queues_max"), ("mq_msg_max", "fs/mqueue/msg_max"),
    ("mq_msgsize_max", "fs/mqueue/msgsize_max"), ("mq_msg_default", "fs/mqueue/msg_default"),
    ("mq_msgsize_default", "fs/mqueue/msgsize_default"),
)
#: ... and the next ids, kept only when set (-1 cannot be written back)
NEXT_IDS = (("msg_next_id", "kernel/msg_next_id"), ("sem_next_id", "kernel/sem_next_id"),
            ("shm_next_id", "kernel/shm_next_id"))
SYSV = ("shm", "msg", "sem")  # /proc/sysvipc/*: a header line, then one line per object
#: CRIU's error for a SysV shared-memory mapping of a namespace it does not dump
SYSV_SHM_ELSEWHERE = "doesn't live in IPC ns"


class HasSysvObjects(Exception):
    """The tree's IPC namespace holds SysV objects: dump again with criu in its own."""


@dataclass(frozen=True)
class Seen:
    """What the tree's UTS and IPC namespaces held while it was frozen."""

    nodename: str
    domainname: str
    ipc_var: dict[str, Any]  # an IpcVarEntry as pycriu decodes it
    sysv_objects: int


def _read(name: str) -> str:
    with open(f"{SYSCTL}/{name}") as f:
        return f.read().strip()


def read_here() -> Seen:
    """The UTS and IPC namespace of the calling thread."""
    var: dict[str, Any] = {"sem_ctls": [int(x) for x in _read("kernel/sem").split()]}
    for key, name in IPC_VARS:
        try:
            var[key] = int(_read(name))
        except FileNotFoundError:  # auto_msgmni is gone from newer kernels: CRIU reads 0
            var[key] = 0
    if os.access(f"{SYSCTL}/fs/mqueue", os.X_OK):
        for key, name in MQ_VARS:
            var[key] = int(_read(name))
    for key, name in NEXT_IDS:
        value = int(_read(name))
        if value != -1:
            var[key] = value
    return Seen(_read("kernel/hostname"), _read("kernel/domainname"), var, _sysv_here())


def _sysv_here() -> int:
    """The SysV objects of the calling thread's IPC namespace."""
    objects = 0
    for kind in SYSV:
        with open(f"/proc/sysvipc/{kind}") as f:
            objects += max(0, len(f.read().splitlines()) - 1)
    return objects


def sysv_objects(pid: int) -> int:
    """How many SysV objects the IPC namespace of ``pid`` holds, read from a thread that joins
    it (before a dump: a tree holding any is dumped with CRIU's own IPC dumper, since CRIU
    refuses a SysV shared-memory mapping outside the IPC namespace it dumps)."""
    fd = os.open(f"/proc/{pid}/ns/ipc", os.O_RDONLY | os.O_CLOEXEC)
    found: list[int] = []
    failed: list[BaseException] = []

    def count() -> None:
        try:
            sc.setns(fd, sc.CLONE_NEWIPC)  # this thread only; it ends here
            found.append(_sysv_here())
        except BaseException as e:  # noqa: BLE001 (raised by the caller)
            failed.append(e)

    try:
        t = threading.Thread(target=count, name="bunshin-sysv-count", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(fd)
    if failed:
        raise BunshinError(f"the workspace's IPC namespace could not be read: {failed[0]}",
                           hint="the workspace keeps running, nothing was forked") from failed[0]
    return found[0]


@dataclass
class Reader:
    """Reads the UTS and IPC namespaces of ``pid`` from a thread that joins them: made and
    joined at ``prepare`` (before the freeze: no thread starts inside the pause), reading
    at ``start``; the namespaces are opened at once, bound to that process. ``result``
    awaits it; ``notify`` composes it with other ``criu.dump`` handlers."""

    pid: int
    _fds: list[int] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _go: threading.Event = field(default_factory=threading.Event)
    _seen: Seen | None = None
    _error: BaseException | None = None

    def __post_init__(self) -> None:
        for ns in ("uts", "ipc"):
            self._fds.append(os.open(f"/proc/{self.pid}/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))

    def _run(self) -> None:
        try:
            for fd, kind in zip(self._fds, (sc.CLONE_NEWUTS, sc.CLONE_NEWIPC), strict=True):
                sc.setns(fd, kind)  # this thread only; it ends here
            self._go.wait()
            self._seen = read_here()
        except BaseException as e:  # noqa: BLE001 (handed to result's caller)
            self._error = e

    def prepare(self) -> None:
        """The thread, in the namespaces, waiting for ``start``."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bunshin-ns-reader", daemon=True)
            self._thread.start()

    def start(self) -> None:
        """Read now (the tasks are frozen)."""
        self.prepare()
        self._go.set()

    def result(self) -> Seen:
        self.start()
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise BunshinError(f"the workspace's UTS and IPC namespaces could not be read: {self._error}",
                               hint="the workspace keeps running, nothing was forked") from self._error
        assert self._seen is not None
        return self._seen

    def check(self) -> None:
        """``post-dump``: the namespaces are read; refuse the dump if CRIU had SysV objects to dump."""
        if self.result().sysv_objects:
            raise HasSysvObjects("the workspace holds SysV IPC objects: dumped again with CRIU's own dumper")

    def close(self) -> None:
        if self._thread is not None:  # a dump that failed before query-ext-files
            self._go.set()
            self._thread.join()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def notify(self, handlers: dict[str, Any]) -> dict[str, Any]:
        """``handlers`` with this reader started at ``query-ext-files`` and checked at ``post-dump``;
        its thread is made now, before the dump (``prepare``): one started at ``pre-dump`` was
        still starting at ``query-ext-files`` and held the GIL its answer needed (that round trip
        p50 0.55 against 0.09 ms, 20 dumps each, alternated, load ~2.5; ``freeze_boost``)."""
        self.prepare()
        out = dict(handlers)
        out["query-ext-files"] = _both(handlers.get("query-ext-files"), self.start)
        out["post-dump"] = _both(handlers.get("post-dump"), self.check)
        return out


def _both(first: Any, second: Any) -> Any:
    def run() -> None:
        if first is not None:
            first()
        second()
    return run


def tree_ids(images: Path) -> tuple[int, int]:
    """The UTS and IPC namespace ids of the dumped tree (one each for all its tasks)."""
    ids = {(int(e["uts_ns_id"]), int(e["ipc_ns_id"])) for p in images.glob("ids-*.img")
           for e in load(p)["entries"][:1]}
    if len(ids) != 1:
        raise BunshinError(f"the dump holds {len(ids)} UTS/IPC namespace pairs; a workspace has one",
                           hint="report this: a workspace's tasks share their namespaces")
    return ids.pop()


def add(images: Path, seen: Seen) -> None:
    """Put the tree's UTS and IPC namespaces (``seen``) into the dump in ``images``, made
    with criu in them; a dump CRIU wrote them in itself is left as it is."""
    uts, ipc = tree_ids(images)
    inv = load(images / "inventory.img")
    root = inv["entries"][0]["root_ids"]
    if root.get("uts_ns_id") != uts or root.get("ipc_ns_id") != ipc:
        return
    used = [v for p in images.glob("ids-*.img") for k, v in load(p)["entries"][0].items() if k.endswith("_id")]
    fresh = max([*used, *root.values()]) + 1
    root["uts_ns_id"], root["ipc_ns_id"] = fresh, fresh + 1
    save({"magic": "UTSNS", "entries": [{"nodename": seen.nodename, "domainname": seen.domainname}]},
         images / f"utsns-{uts}.img")
    save({"magic": "IPC_VAR", "entries": [seen.ipc_var]}, images / f"ipcns-var-{ipc}.img")
    save(inv, images / "inventory.img")  # last: a dump left half-way restores in criu's namespaces
