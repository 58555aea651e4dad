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
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from ..config import Config
from ..errors import BunshinError, HostUnsupported
from . import freeze_boost, prepared
from .criu import Placement

_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror")
LOG = "upper-copy.log"  # the copier's complaints, in the snapshot's folder


def _source() -> bytes:
    return resources.files(__package__).joinpath("upper_copy.c").read_bytes()


def build(cache_dir: Path) -> Path:
    """The copier, compiled into ``cache_dir`` the first time (keyed by source and flags)."""
    src = _source()
    key = hashlib.sha256(src + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"upper-copy-{key}"
    if path.exists():
        return path
    gcc = shutil.which("gcc")
    if gcc is None:
        raise HostUnsupported("gcc is needed to build the copier of frozen layers", hint="install gcc (make install does)")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(prefix="bunshin-upper-copy-") as tmp:
        (Path(tmp) / "upper_copy.c").write_bytes(src)
        out = Path(tmp) / "upper-copy"
        proc = subprocess.run([gcc, *_CFLAGS, "-o", str(out), str(Path(tmp) / "upper_copy.c")],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise HostUnsupported(f"building the copier of frozen layers failed: {proc.stderr.strip()[-400:]}",
                                  hint="check that gcc works (make install installs it)")
        os.chmod(out, 0o700)
        os.replace(out, path)  # whole or not at all, also with two builders at once
    return path


class FrozenCopy:
    """A copier waiting for its go; ``run`` (while the tasks are frozen) copies and waits.
    ``notify`` is what ``criu.dump`` takes: the copier is boosted at CRIU's ``pre-dump``
    stage (before the freeze: the boost's timer thread is not started inside the pause)
    and ``run`` at its ``post-dump`` stage."""

    def __init__(self, go: int, done: int, pid: int, pidfd: int, log: Path) -> None:
        self._go, self._done, self.pid, self._pidfd, self._log = go, done, pid, pidfd, log
        self.boost = freeze_boost.Boost((pid,))  # real-time priority within freeze_boost's budget
        self.notify = {"pre-dump": self.boost.start, "post-dump": self.run}

    def run(self) -> None:
        """Copy now; raise ``BunshinError`` with the copier's own words if it failed."""
        try:
            self._copy()
        finally:
            self.boost.stop()

    def _copy(self) -> None:
        os.write(self._go, b"g")
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
def frozen_copy(cfg: Config, upper: Path, layer: Path, folder: Path, memcg: Path | None) -> Iterator[FrozenCopy]:
    """Start the copier of ``upper`` into the new folder ``layer`` in ``memcg``; yield it.
    On exit a copier not told to copy reads EOF and ends; every copier is awaited."""
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
            copy = FrozenCopy(go, done, child.pid, pidfd, log)
            try:
                yield copy
            finally:
                copy.boost.stop()  # a dump that failed before post-dump
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
