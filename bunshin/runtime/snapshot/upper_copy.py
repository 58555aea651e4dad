"""The frozen copy of a workspace's upper, taken at the dump instant and charged to it.

CRIU records the sizes of open overlay files, so the upper must be copied while the
tasks are frozen: CRIU's ``post-dump`` notification is the moment (``criu.dump``'s
``post_dump``). The copy's pages are charged to the workspace's memory cgroup (its
family pays for the layers its forks leave), but moving a process into a v1 memory
cgroup costs ~14 ms, which would be paid inside the pause. So a copier is started in
the cgroup *before* the dump: ``upper_copy.c``, built once per source with gcc, which
opens two fifos and waits. ``FrozenCopy.run`` writes one byte to the first and waits
for the copier's answer on the second: no process starts inside the pause (a shell
action script that woke a waiting ``cp -a``: 2.9-4.7 ms of it, mostly the two execs).

An *early* copy (``frozen_copy(..., early=images)``) is told to go at CRIU's
``query-ext-files`` notification instead, which CRIU sends once every task is frozen:
the copier then runs on the other CPU while CRIU dumps, and ``post-dump`` only waits for
its answer. CRIU itself writes into the upper while it dumps in one case: an open file
whose name is gone but which has other links is linked back as ``link_remap.N`` beside
it, and the clones' restore opens that name. An early copy may have missed it, so a dump
that recorded such a remap (``linked_remaps``) fails at ``post-dump`` (``LinkedRemaps``)
and is made again with the copy at ``post-dump`` (``snapshot.take``).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from ...config import Config
from ...errors import BunshinError
from ..criu import freeze_boost, prepared
from ..criu.run import Placement
from ..kernel import cbuild
from ..memfile import criu_images

_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
LOG = "upper-copy.log"  # the copier's complaints, in the snapshot's folder
REMAPS = "remap-fpath.img"  # CRIU's remaps of open files, written only when there are any
_LINKED = (0, "LINKED")  # remap_type of a file CRIU linked back into the tree (the field's default)


class LinkedRemaps(Exception):
    """An early copy may lack the files CRIU linked back into the upper: dump again with
    the copy at ``post-dump``."""


def linked_remaps(images: Path) -> bool:
    """Whether the dump in ``images`` linked an open file back into the tree (an image
    that cannot be read counts as one)."""
    path = Path(images) / REMAPS
    if not path.exists():
        return False
    try:
        entries = criu_images.load(path)["entries"]
    except Exception:  # noqa: BLE001 (pycriu's own errors too: a bad magic, a short read)
        return True
    return any(e.get("remap_type", 0) in _LINKED for e in entries)


def start_over(images: Path, layer: Path) -> None:
    """Empty ``images`` and remove ``layer``: what a failed attempt left, before the next."""
    shutil.rmtree(images, ignore_errors=True)
    Path(images).mkdir(parents=True)
    shutil.rmtree(layer, ignore_errors=True)


def build(cache_dir: Path) -> Path:
    """The copier, compiled into ``cache_dir`` the first time."""
    return cbuild.build(__package__, "upper_copy.c", cache_dir, "upper-copy", _CFLAGS, what="the copier of frozen layers")


class FrozenCopy:
    """A copier waiting for its go; ``run`` (while the tasks are frozen) copies and waits.
    ``notify`` is what ``criu.dump`` takes: the copier is boosted at CRIU's ``pre-dump``
    stage (before the freeze: the boost's timer thread is not started inside the pause),
    told to go at ``query-ext-files`` when ``early`` (the images folder), and ``run`` at
    ``post-dump``."""

    def __init__(self, go: int, done: int, pid: int, pidfd: int, log: Path, early: Path | None = None) -> None:
        self._go, self._done, self.pid, self._pidfd, self._log = go, done, pid, pidfd, log
        self._early, self._begun = early, False
        self._remaps = os.path.join(early, REMAPS) if early is not None else None  # looked up inside the pause
        self.boost = freeze_boost.Boost((pid,))  # real-time priority within freeze_boost's budget
        self.notify = {"pre-dump": self.boost.start, "post-dump": self.run}
        if early is not None:
            self.notify["query-ext-files"] = self.begin

    def begin(self) -> None:
        """Tell the copier to copy (once); the tasks must be frozen until ``run`` returns."""
        if not self._begun:
            os.write(self._go, b"g")
            self._begun = True

    def run(self) -> None:
        """Copy now (or wait for the copy begun); raise ``BunshinError`` with the copier's own
        words if it failed, ``LinkedRemaps`` if an early copy may lack CRIU's links.

        The copier's boost is not stopped here but once the dump is over (``frozen_copy``):
        cancelling its budget timer wakes that thread, which then holds the GIL while it
        ends, inside the pause (~0.1-0.2 ms of this answer)."""
        self.begin()
        self._wait()
        if self._remaps is not None and os.path.exists(self._remaps) and linked_remaps(Path(self._remaps).parent):
            raise LinkedRemaps("CRIU linked an open file back into the workspace's files after the early copy: "
                               "the dump is made again with the copy at its end")

    def _wait(self) -> None:
        poller = select.poll()
        poller.register(self._done, select.POLLIN)
        poller.register(self._pidfd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            try:
                answer = os.read(self._done, 16)  # "" once the copier has gone without a word
                break
            except BlockingIOError:
                if self._pidfd in ready:  # ended before it opened its end
                    answer = b""
                    break
        if answer.strip() != b"0":
            raise BunshinError(f"the frozen copy of the workspace's files failed: {self._why()}",
                               hint="see the message; the workspace keeps running, nothing was forked")

    def _why(self) -> str:
        with contextlib.suppress(OSError):
            text = self._log.read_text(errors="replace").strip()
            if text:
                return text.splitlines()[-1]
        return "the copier ended without saying why"


@contextlib.contextmanager
def frozen_copy(cfg: Config, upper: Path, layer: Path, folder: Path, memcg: Path | None, *,
                early: Path | None = None) -> Iterator[FrozenCopy]:
    """Start the copier of ``upper`` into the new folder ``layer`` in ``memcg``; yield it
    (``early``: the dump's images folder, for an early copy). On exit a copier not told to
    copy reads EOF and ends; every copier is awaited."""
    binary = build(cfg.paths.helpers)
    go_path, done_path = folder / "copy-go", folder / "copy-done"
    os.mkfifo(go_path, 0o600)
    os.mkfifo(done_path, 0o600)
    # held open here: the copier's opens never block, and it reads EOF when we close ours
    go = os.open(go_path, os.O_RDWR | os.O_CLOEXEC)
    done = os.open(done_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    log = folder / LOG
    argv = [str(binary), str(go_path), str(done_path), str(upper), str(layer)]
    into = Placement(cgroup_procs=(str(memcg / "cgroup.procs"),) if memcg is not None else ())
    pidfd = -1
    try:
        with open(log, "wb") as out:
            child = _start(argv, into, out.fileno())
        try:
            pidfd = os.pidfd_open(child.pid)
            copy = FrozenCopy(go, done, child.pid, pidfd, log, early)
            copy.boost.arm()  # (its timer thread started before the dump)
            try:
                yield copy
            finally:
                copy.boost.stop()  # after the dump (or its failure), never inside the pause
        finally:
            os.close(go)
            go = -1
            child.wait()
    finally:
        for fd in (go, done, pidfd):
            if fd >= 0:
                os.close(fd)
        for f in (go_path, done_path):
            f.unlink(missing_ok=True)


def _start(argv: list[str], into: Placement, out_fd: int) -> prepared.Started | subprocess.Popen[bytes]:
    """The copier, started by the warm helper (or by this process), in its cgroup."""
    try:
        started = prepared.start(argv, into, out_fd)
        if started is not None:
            return started
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=out_fd, close_fds=True,
                                preexec_fn=into.enter)  # noqa: PLW1509 (syscalls only)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BunshinError(f"the copier of the workspace's files could not start: {exc}",
                           hint="check the workspace's memory cgroup; `bunshin doctor` checks the host") from exc
